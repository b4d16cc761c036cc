"""``veth_namespace``: two pairs made at once get distinct subnets; ``namespace_pair``: two namespaces that
reach each other and this one (real namespaces; needs root)."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

from kvoffload_testing.netns import IP, in_namespace, veth_namespace


def test_pairs_made_at_once_get_subnets_of_their_own_and_each_namespace_answers_on_its_own():
    with ExitStack() as stack, ThreadPoolExecutor(3) as pool:
        veths = list(pool.map(lambda _: stack.enter_context(veth_namespace()), range(3)))
        assert len({v.here for v in veths} | {v.there for v in veths}) == 6, veths
        for v in veths:  # each far end is in its own namespace
            show = in_namespace(v.name, [IP, "-o", "-4", "addr", "show"])
            assert f" {v.there}/30" in subprocess.run(show, check=True, capture_output=True, text=True).stdout
    held = subprocess.run([IP, "-o", "-4", "addr", "show"], check=True, capture_output=True, text=True).stdout
    assert not any(f" {v.here}/" in held for v in veths), held  # removed after


def test_a_namespace_pair_reaches_each_other_over_its_link_and_this_namespace_over_its_own():
    """A server in one namespace answers a client in the other (their own link, not forwarded here), and
    a server here on one pair's address answers a client in the other namespace (its default route)."""
    import socket
    import sys

    from kvoffload_testing.netns import namespace_pair

    serve = "import socket,sys; s=socket.socket(); s.bind((sys.argv[1], 7977)); s.listen(); print('up', flush=True); "
    serve += "c, a = s.accept(); c.sendall(a[0].encode()); c.close()"
    ask = "import socket,sys; print(socket.create_connection((sys.argv[1], 7977), timeout=5).recv(64).decode())"
    with namespace_pair() as (a, b):
        server = subprocess.Popen(in_namespace(b.name, [sys.executable, "-c", serve, b.there]), stdout=subprocess.PIPE)
        try:
            assert server.stdout.readline() == b"up\n"
            client = subprocess.run(in_namespace(a.name, [sys.executable, "-c", ask, b.there]), capture_output=True)
            assert client.stdout.decode().strip() == a.there, client  # B saw A's own address: not routed here
        finally:
            server.kill()
        with socket.socket() as here:
            here.bind((a.here, 7977))
            here.listen()
            client = subprocess.Popen(in_namespace(b.name, [sys.executable, "-c", ask, a.here]), stdout=subprocess.PIPE)
            conn, peer = here.accept()
            conn.sendall(b"ok")
            conn.close()
            assert client.communicate(timeout=10)[0].decode().strip() == "ok" and peer[0] == b.there
