"""Every host-pool backend of ``kvcore.pool.registry`` is known where the command line runs one: the
pools a stack takes (``kvoffload up --pool``) are the registry's stack pools, each with its server,
its fault table and its server's kill; ``kvoffload bench pool`` measures every backend."""

from __future__ import annotations

from kvcore.pool.registry import EMBEDDED, POOL_BACKENDS, STACK_POOLS
from kvoffload.cli import build_parser
from kvoffload_bench import pool as bench_pool
from kvoffload_testing import fault_catalog, stack


def test_the_stack_runs_the_server_of_each_of_its_pools_and_the_fault_suite_knows_them():
    assert set(stack.POOL_SERVERS) == set(STACK_POOLS) == set(fault_catalog.FAULTS_BY_POOL)
    assert (stack.METASTORE, stack.MOONCAKE_MASTER) == ("metastore", "mooncake-master")
    assert fault_catalog.SERVER_FAULTS == {"kill_metastore": "metastore", "kill_mooncake_master": "mooncake-master"}
    for pool, faults in fault_catalog.FAULTS_BY_POOL.items():  # each pool's table kills its own server
        service = POOL_BACKENDS[pool].stack.service
        assert [f for f in faults if f in fault_catalog.SERVER_FAULTS] == [f"kill_{service.replace('-', '_')}"]


def test_the_command_line_offers_the_stack_pools():
    parser = build_parser()
    assert parser.parse_args(["up"]).pool == EMBEDDED
    assert parser.parse_args(["demo", "--pool", "mooncake"]).pool == "mooncake"
    assert parser.parse_args(["bench", "faults", "--pool", "mooncake"]).pool == "mooncake"
    up = next(a for a in parser._subparsers._group_actions[0].choices["up"]._actions if a.dest == "pool")
    assert tuple(up.choices) == STACK_POOLS


def test_the_pool_bench_measures_every_backend():
    assert set(bench_pool.MEASURES) == set(POOL_BACKENDS)
