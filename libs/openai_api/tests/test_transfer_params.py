"""KVTransferParams: the wire's field names both ways, strict types refused naming the field, the
fields it does not name relayed verbatim, and the decode endpoints a prefill reads from it."""

import pytest

from openai_api.body import RequestError
from openai_api.transfer_params import KVTransferParams, parse_transfer_params, parse_transfer_params_list


def test_what_the_proxy_sends_the_decode_round_trips():
    wire = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "metaserver": "http://p/v1/metaserver",
        "request_id": "cmpl-1",
        "metaserver_token": "abc",
    }
    params = parse_transfer_params(wire)
    assert params.wire() == wire and params.registration_token == "abc"
    assert KVTransferParams(**wire) == params


def test_a_registration_keeps_the_fields_of_other_decoders_verbatim():
    wire = {
        "remote_host": "10.0.0.2",
        "remote_port": 30000,
        "remote_dp_size": 1,
        "remote_tp_size": 2,
        "engine_id": "d0",
        "request_id": "r",
    }
    params = parse_transfer_params(wire)
    assert params.wire() == wire
    assert params.decode_endpoints() == ["10.0.0.2:30000", "10.0.0.2:30001"]


def test_absent_null_or_empty_is_no_wiring():
    assert parse_transfer_params(None) is None and parse_transfer_params({}) is None


@pytest.mark.parametrize(
    "value, where",
    [
        ("x", "kv_transfer_params:"),
        ({"remote_port": True}, "kv_transfer_params.remote_port:"),
        ({"remote_port": 70000}, "kv_transfer_params.remote_port:"),
        ({"remote_port": "80"}, "kv_transfer_params.remote_port:"),
        ({"remote_tp_size": 0}, "kv_transfer_params.remote_tp_size:"),
        ({"request_id": 3}, "kv_transfer_params.request_id:"),
        ({"do_remote_prefill": "yes"}, "kv_transfer_params.do_remote_prefill:"),
        ({"queued": 1}, "kv_transfer_params.queued:"),
    ],
)
def test_wrong_types_are_refused_naming_the_field(value, where):
    with pytest.raises(RequestError) as e:
        parse_transfer_params(value)
    assert str(e.value).startswith(where), e.value


def test_decode_endpoints_need_host_and_port_within_range():
    for wire in (
        {"request_id": "r"},
        {"remote_host": "h"},
        {"remote_host": "h", "remote_port": 65535, "remote_tp_size": 2},
    ):
        with pytest.raises(RequestError, match="remote_host .* remote_port"):
            parse_transfer_params(wire).decode_endpoints()
    assert parse_transfer_params({"remote_host": "h", "remote_port": 65535}).decode_endpoints() == ["h:65535"]


def test_an_odd_token_is_never_sent():
    assert parse_transfer_params({"metaserver_token": "a b"}).registration_token is None
    assert parse_transfer_params({"metaserver_token": "x" * 257}).registration_token is None


def test_the_list_gives_one_entry_per_child_and_names_the_bad_one():
    assert parse_transfer_params_list([None, {"request_id": "b"}], 2)[1].request_id == "b"
    with pytest.raises(RequestError, match=r"^kv_transfer_params_list: must give one entry per prompt and choice"):
        parse_transfer_params_list([None], 3)
    with pytest.raises(RequestError, match=r"^kv_transfer_params_list\[1\]\.remote_port"):
        parse_transfer_params_list([None, {"remote_port": -1}], 2)
