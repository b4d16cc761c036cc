"""An OpenAI body is validated once, where its type is defined: ``openai_api.body.validate_body`` over
the models of ``openai_api.body_types``. Every edge that takes a body (the proxy's
``parse_inference``, ``parse_request`` of the decode and the offload-only prefill, the prefill
dispatch's ``parse_dispatch``) refuses the same bad bodies with the same message, raised inside that
one function; each service's routes read bodies through those edges; and no other module defines a
body's model or validates one. A second validation path fails here."""

from __future__ import annotations

import ast
import json
import traceback
from pathlib import Path

import pytest
from package_tree import ROOT, packages

from dsamodel.tokenizer import ByteTokenizer
from kvoffload_proxy.errors import ProxyError
from kvoffload_proxy.schemas import parse_inference
from openai_api.body import RequestError, validate_body
from openai_api.body_types import ChatCompletionRequest, CompletionRequest
from openai_api.dispatch import parse_dispatch
from openai_api.request import parse_request

TOK = ByteTokenizer()
MSG = [{"role": "user", "content": "hi"}]
# one bad body per kind of rule: unknown, refused by name, type, bound, union, nested, combination
BAD = [
    (False, {"prompt": "x", "frobnicate": 1}),
    (False, {"prompt": "x", "logit_bias": {}}),
    (True, {"messages": MSG, "echo": True}),
    (False, {}),
    (False, {"prompt": ""}),
    (False, {"prompt": [1, "a"]}),
    (False, {"prompt": "x", "stream": "yes"}),
    (False, {"prompt": "x", "max_tokens": 1.5}),
    (False, {"prompt": "x", "n": 65}),
    (False, {"prompt": "x", "temperature": 3}),
    (False, {"prompt": "x", "top_p": 0}),
    (False, {"prompt": "x", "seed": -1}),
    (False, {"prompt": "x", "stop": ["a"] * 17}),
    (False, {"prompt": "x", "stop_token_ids": [-1]}),
    (False, {"prompt": "x", "presence_penalty": 9}),
    (False, {"prompt": "x", "logprobs": 21}),
    (False, {"prompt": "x", "model": 3}),
    (False, {"prompt": "x", "stream": True, "stream_options": {"x": 1}}),
    (False, {"prompt": "x", "stream_options": {"include_usage": True}}),
    (False, {"prompt": "x", "best_of": 2}),
    (False, {"prompt": "x", "echo": True, "logprobs": 0}),
    (False, {"prompt": "x", "min_tokens": 5, "max_tokens": 6, "n": 70}),
    (True, {"messages": []}),
    (True, {"messages": [{"role": "tool", "content": "x"}]}),
    (True, {"messages": [{"role": "user", "content": "x", "name": "a"}]}),
    (True, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    (True, {"messages": MSG, "top_logprobs": 2}),
    (True, {"messages": MSG, "max_completion_tokens": 0}),
]
# the modules whose routes take OpenAI bodies, and the one edge each reads them through
ROUTES = {
    "services/decode/src/kvoffload_decode/app.py": "parse_request",
    "services/prefill/src/kvoffload_prefill/offload_app.py": "parse_request",
    "services/prefill/src/kvoffload_prefill/app.py": "parse_dispatch",
    "services/proxy/src/kvoffload_proxy/app.py": "parse_inference",
}


def _edges(raw: bytes, chat: bool) -> dict:
    return {
        "proxy": lambda: parse_inference("chat" if chat else "completions", raw),
        "decode / offload-only prefill": lambda: parse_request(raw, TOK, chat=chat, max_model_len=4096),
        "prefill dispatch": lambda: parse_dispatch(raw, TOK, chat=chat, max_model_len=4096),
    }


def _raised_in_validate_body(err: BaseException) -> bool:
    frames = traceback.extract_tb(err.__traceback__)
    return any(f.name == "validate_body" and f.filename.endswith("openai_api/body.py") for f in frames)


@pytest.mark.parametrize("chat, body", BAD, ids=lambda v: json.dumps(v) if isinstance(v, dict) else str(v))
def test_every_edge_refuses_a_bad_body_with_the_one_message(chat, body):
    with pytest.raises(RequestError) as want:
        validate_body(body, chat=chat)
    assert ": " in str(want.value) and want.value.detail, want.value  # "<field>: <rule>"
    for edge, call in _edges(json.dumps(body).encode(), chat).items():
        with pytest.raises((RequestError, ProxyError)) as got:
            call()
        err = got.value
        if isinstance(err, ProxyError):
            assert (err.status, err.message, err.param) == (400, str(want.value), want.value.field), edge
            err = err.__context__  # the RequestError it answers
        assert isinstance(err, RequestError) and str(err) == str(want.value), (edge, err)
        assert _raised_in_validate_body(err), f"{edge}: refused outside openai_api.body.validate_body"


def _calls(tree: ast.AST) -> set[str]:
    return {
        node.func.id if isinstance(node.func, ast.Name) else node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute))
    }


@pytest.mark.parametrize("path, edge", sorted(ROUTES.items()))
def test_each_service_reads_its_bodies_through_one_edge(path, edge):
    calls = _calls(ast.parse((ROOT / path).read_text()))
    assert edge in calls, f"{path} no longer reads its bodies with {edge}"
    others = {"parse_inference", "parse_request", "parse_dispatch", "validate_body", "validated"} - {edge}
    assert not calls & others, f"{path} reads a body another way too: {sorted(calls & others)}"


# fields only an OpenAI body (or the settings it maps to) has together
_BODY_FIELDS = (set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)) - {
    "model",
    "n",
    "user",
    "stream",
}
# classes that may hold several of them, each with why
ALLOWED = {
    ("openai_api/body_types.py", "_Generate"): "the typed bodies themselves",
    ("openai_api/body_types.py", "CompletionRequest"): "the typed bodies themselves",
    ("openai_api/body_types.py", "ChatCompletionRequest"): "the typed bodies themselves",
    ("openai_api/sampling_params.py", "SamplingParams"): "the sampler's settings a checked body maps to",
}


def _source_files() -> list[Path]:
    return [p for d in packages().values() for p in d.rglob("*.py") if "tests" not in p.relative_to(d).parts]


def _validates_a_body(call: ast.Call) -> bool:
    """``CompletionRequest(...)``, ``ChatCompletionRequest.model_validate(...)``, ``validated(CompletionRequest,
    ...)``, ``TypeAdapter(ChatCompletionRequest)``, ...: a body model built or validated."""
    models = {"CompletionRequest", "ChatCompletionRequest", "OpenAIRequest"}
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
    args = {a.id for a in call.args if isinstance(a, ast.Name)}
    return (
        name in models
        or (owner in models and name.startswith(("model_validate", "model_construct")))
        or (name in {"validated", "TypeAdapter"} and bool(args & models))
    )


def test_no_other_module_types_or_validates_a_body():
    """A class with several of a body's fields is a second body type; a call validating the body
    models outside ``openai_api/body.py`` is a second validation."""
    found = []
    for path in _source_files():
        rel = f"{path.parent.name}/{path.name}"
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names = {
                    s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                }
                if len(names & _BODY_FIELDS) >= 3 and (rel, node.name) not in ALLOWED:
                    found.append(f"{path}: class {node.name} types {sorted(names & _BODY_FIELDS)}")
            if isinstance(node, ast.Call) and rel != "openai_api/body.py" and _validates_a_body(node):
                found.append(f"{path}:{node.lineno}: validates a body model itself")
    assert not found, "\n".join(found)
    assert ALLOWED, "the allow-list names the bodies themselves"
