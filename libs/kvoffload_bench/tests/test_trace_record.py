"""Recording top-k traces (kvoffload_bench.trace_record) on a tiny random Llama with a tiny BPE tokenizer:
the prompts, the trace's layout and metadata, determinism, and the selections against an independent
full-sequence forward pass."""

import json

import pytest
import torch

from kvcore.traces.trace import Trace
from kvoffload_bench import trace_prompts
from kvoffload_bench import trace_record as tr

CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONTEXT, STEPS, TOPK, REQUESTS = 64, 6, 8, 2
VOCAB = 400


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [trace_prompts.INSTRUCTION, "the cache keeps the attention of the model"],
        trainers.BpeTrainer(
            vocab_size=VOCAB,
            special_tokens=["<|im_start|>", "<|im_end|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    out.chat_template = CHAT
    return out


def tiny_llama(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.2,
    )  # large enough that attention is far from uniform
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.set_attn_implementation("eager")
    return model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    (path / "kvoffload-provenance.json").write_text(json.dumps({"model": "tiny test llama"}))
    return path


@pytest.fixture(scope="module")
def trace(tiny_dir):
    return tr.record(tiny_dir, name="tiny", context=CONTEXT, steps=STEPS, topk=TOPK, requests=REQUESTS)


def test_select_orders_by_score_then_position():
    scores = torch.tensor([[0.1, 0.3, 0.3, 0.2, 0.3, 0.1]])
    assert tr.select(scores, 4).tolist() == [[1, 2, 4, 3]]
    g = torch.Generator().manual_seed(1)
    many = torch.randint(0, 5, (6, 50), generator=g).float()  # many ties
    got = tr.select(many, 10).tolist()
    assert got == [sorted(range(50), key=lambda p: (-row[p], p))[:10] for row in many.tolist()]


def test_prompts_are_exact_chat_prompts_on_different_documents():
    tok = tiny_tokenizer()
    ids, sources = trace_prompts.prompt_ids(tok, context=CONTEXT, requests=3)
    assert ids.shape == (3, CONTEXT) and ids.dtype == torch.long
    suffix = tok("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    prefix = tok("<|im_start|>user\n" + trace_prompts.INSTRUCTION, add_special_tokens=False)["input_ids"]
    for row in ids.tolist():
        assert row[: len(prefix)] == prefix and row[-len(suffix) :] == suffix
    assert [s[0] for s in sources] == list(trace_prompts.SOURCES[:3])
    assert len({tuple(row) for row in ids.tolist()}) == 3  # different text per request
    with pytest.raises(ValueError, match="too short"):
        trace_prompts.prompt_ids(tok, context=len(prefix) + len(suffix), requests=1)


def test_trace_layout_and_metadata(trace):
    L, G = 2, 2
    assert isinstance(trace, Trace) and trace.name == "tiny"
    assert trace.topk.shape == (REQUESTS * L * G, STEPS, TOPK) and trace.topk.dtype == torch.int32
    assert trace.context0.tolist() == [CONTEXT] * (REQUESTS * L * G)
    assert trace.requests.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]  # request-major,
    assert trace.layers.tolist() == [0, 0, 1, 1, 0, 0, 1, 1]  # then layer,
    assert trace.groups.tolist() == [0, 1, 0, 1, 0, 1, 0, 1]  # then KV group
    m = trace.meta
    assert m["kind"] == "recorded" and m["model"] == "tiny"
    assert m["model_provenance"] == {"model": "tiny test llama"}
    assert (m["context"], m["steps"], m["topk"], m["requests"]) == (CONTEXT, STEPS, TOPK, REQUESTS)
    assert m["topk_fraction"] == TOPK / CONTEXT and "attention probability" in m["score"]
    assert [s["paths"][0] for s in m["sources"]] == list(trace_prompts.SOURCES[:REQUESTS])
    assert set(m["versions"]) == {"transformers", "torch"}
    assert len(m["generated"]) == REQUESTS and all(isinstance(text, str) and text for text in m["generated"])
    json.dumps(m)  # Trace.save stores it as JSON


def test_rows_hold_distinct_positions_in_the_growing_context(trace):
    t = trace.topk.long()
    limit = (CONTEXT + torch.arange(STEPS)).view(1, -1, 1)
    assert bool((t >= 0).all()) and bool((t < limit).all())
    ordered = t.sort(-1).values
    assert bool((ordered[..., 1:] != ordered[..., :-1]).all())
    assert bool((t >= CONTEXT).any())  # the generated tokens themselves get selected


def test_recording_is_deterministic(tiny_dir, trace, tmp_path):
    again = tr.record(tiny_dir, name="tiny", context=CONTEXT, steps=STEPS, topk=TOPK, requests=REQUESTS)
    assert torch.equal(again.topk, trace.topk) and again.meta == trace.meta
    back = Trace.load(again.save(tmp_path / "t.pt"))
    assert torch.equal(back.topk, trace.topk) and back.meta == trace.meta


def test_selections_match_a_full_forward_pass():
    """Each decode step's rows equal the top-k of the group scores read from one eager forward pass
    over the whole sequence (prompt + generated tokens), and the tokens are its greedy choices."""
    model = tiny_llama(torch.float64)  # float64: no near-ties between the two computations
    C, steps, k, H, G = 20, 5, 6, 4, 2
    prompts = torch.randint(0, VOCAB, (1, C), generator=torch.Generator().manual_seed(2))
    topk, generated = tr.record_ids(model, prompts, steps=steps, topk=k)
    assert topk.shape == (2 * G, steps, k) and generated.shape == (1, steps)
    seq = torch.cat([prompts, generated[:, :-1]], 1)  # [1, C + steps - 1]
    with torch.inference_mode():
        out = model(seq, output_attentions=True)
    assert generated[0].tolist() == out.logits[0, C - 1 :].argmax(-1).tolist()
    for layer, probs in enumerate(out.attentions):  # [1, H, N, N]
        for g in range(G):
            scores = probs[0, g * H // G : (g + 1) * H // G].sum(0)  # [N, N]: the group's heads
            for t in range(steps):
                row = scores[C - 1 + t, : C + t].tolist()
                expect = sorted(range(C + t), key=lambda p: (-row[p], p))[:k]
                assert topk[layer * G + g, t].tolist() == expect, (layer, g, t)


def test_ensure_refuses_unknown_names(tmp_path):
    with pytest.raises(ValueError, match="smollm2"):
        tr.ensure("gpt2", path=tmp_path / "gpt2.pt")


def test_ensure_records_once(tiny_dir, tmp_path, monkeypatch):
    import kvoffload_testing.model_fetch as mf

    monkeypatch.setattr(mf, "cached_model", lambda name, log=print: tiny_dir)
    path = tmp_path / "traces" / "smollm2.pt"
    seen = []
    assert (
        tr.ensure(
            "smollm2",
            path=path,
            log=seen.append,
            progress=lambda d, n: seen.append((d, n)),
            context=CONTEXT,
            steps=2,
            topk=4,
            requests=1,
        )
        == path
    )
    assert Trace.load(path).topk.shape == (4, 2, 4) and seen[-1] == (2, 2)

    def fail(*args, **kwargs):
        raise AssertionError("recorded again")

    monkeypatch.setattr(tr, "record", fail)
    assert tr.ensure("smollm2", path=path, log=seen.append) == path  # already there: not recorded again
    with pytest.raises(AssertionError, match="recorded again"):
        tr.ensure("smollm2", path=path, force=True, log=seen.append)
