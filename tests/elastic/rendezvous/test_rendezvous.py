"""The rendezvous adapters: torch's own static and c10d handlers, awaited off the loop."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

torch_distributed = pytest.importorskip("torch.distributed")
torch_rendezvous = pytest.importorskip("torch.distributed.elastic.rendezvous")

from aioelastic._elastic.rendezvous._handlers import create_rdzv_handler, standalone_handler  # noqa: E402
from aioelastic._elastic.rendezvous._node import LocalRendezvous, Rendezvous, RendezvousOutcome  # noqa: E402
from aioelastic._elastic.settings._node_values import RDZV_OPTIONS, endpoint as parse_endpoint  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.spare_node import SpareNodeHandler  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("torch_store_warmed", "collect_stores")]


async def joined(rdzv: Rendezvous, role: str, size: int, **kw: object) -> RendezvousOutcome:
    outcome = await rdzv.next_rendezvous(role, size, **kw)  # type: ignore[arg-type]
    assert outcome is not None, "torch said this node is not needed"
    return outcome


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_static_single_node_reuses_its_store_across_rounds() -> None:
    port = free_port()
    handler = await create_rdzv_handler("static", f"127.0.0.1:{port}", "job", 1, 1, rank=0)
    rdzv = Rendezvous(handler, owned=True)
    assert rdzv.backend == "static"
    assert rdzv.run_id == "job"
    assert rdzv.use_agent_store
    assert not rdzv.membership_can_change
    first = await joined(rdzv, "trainer", 3)
    assert (first.group_rank, first.group_world_size) == (0, 1)
    assert (first.master_addr, first.master_port) == ("127.0.0.1", port)
    assert (first.base_global_rank, first.world_size) == (0, 3)
    assert (first.base_role_rank, first.role_world_size) == (0, 3)
    again = await joined(rdzv, "trainer", 3, master_addr="10.0.0.1", master_port=1234)
    assert (again.master_addr, again.master_port) == ("10.0.0.1", 1234)
    assert await rdzv.num_nodes_waiting() == 0
    assert await rdzv.exit_barrier(5.0)
    await rdzv.aclose()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_static_fixed_nodes_by_node_rank() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        Rendezvous(await create_rdzv_handler("static", endpoint, "fixed", 2, 2, rank=rank))
        for rank in (0, 1)
    ]
    first, second = await _join_both(nodes[0], nodes[1], (2, 2))
    assert (first.group_rank, second.group_rank) == (0, 1)
    assert (first.base_global_rank, second.base_global_rank) == (0, 2)
    assert first.world_size == second.world_size == 4
    assert second.master_port == int(endpoint.rsplit(":", 1)[1])
    for node in nodes:
        await node.aclose()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_standalone_is_torchruns_single_node_default() -> None:
    rdzv = Rendezvous(await standalone_handler(), owned=True)
    assert rdzv.backend == "c10d"
    assert rdzv.use_agent_store
    assert rdzv.membership_can_change
    outcome = await joined(rdzv, "default", 2)
    assert (outcome.group_rank, outcome.group_world_size, outcome.world_size) == (0, 1, 2)
    # The agent hosts a TCPStore for the workers; they connect to it as clients.
    client = torch_distributed.TCPStore(
        outcome.master_addr, outcome.master_port, is_master=False, wait_for_workers=False
    )
    client.set("hello", "world")
    assert client.get("hello") == b"world"
    del client
    assert await rdzv.num_nodes_waiting() == 0
    # Every round's workers get a store of their own, without the keys of the workers
    # before them (torch 2.13 reuses one, and restarted gloo workers then connect to the
    # dead workers' addresses).
    again = await joined(rdzv, "default", 2)
    assert again.master_port != outcome.master_port
    client = torch_distributed.TCPStore(
        again.master_addr, again.master_port, is_master=False, wait_for_workers=False
    )
    assert not client.check(["hello"])
    del client
    await rdzv.aclose()


async def _join_both(
    a: Rendezvous, b: Rendezvous, sizes: tuple[int, int]
) -> tuple[RendezvousOutcome, RendezvousOutcome]:
    results: dict[str, RendezvousOutcome] = {}

    async def join(name: str, rdzv: Rendezvous, size: int) -> None:
        results[name] = await joined(rdzv, "trainer", size)

    async with anyio.create_task_group() as tg:
        tg.start_soon(join, "a", a, sizes[0])
        tg.start_soon(join, "b", b, sizes[1])
    return results["a"], results["b"]


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_c10d_two_nodes_assign_contiguous_ranks_and_share_the_exit_barrier() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    conf = {"join_timeout": 20, "last_call_timeout": 1, "is_host": True}
    host = Rendezvous(
        await create_rdzv_handler("c10d", endpoint, "two", 2, 2, local_addr="127.0.0.1", **conf),
        owned=True,
    )
    conf["is_host"] = False
    peer = Rendezvous(
        await create_rdzv_handler("c10d", endpoint, "two", 2, 2, local_addr="127.0.0.1", **conf),
        owned=True,
    )
    a, b = await _join_both(host, peer, (1, 3))
    assert sorted([a.group_rank, b.group_rank]) == [0, 1]
    assert a.group_world_size == b.group_world_size == 2
    assert a.world_size == b.world_size == a.role_world_size == 4
    # Nodes take contiguous rank ranges in node order, sized by their worker counts.
    first, second = sorted([(a, 1), (b, 3)], key=lambda pair: pair[0].group_rank)
    assert first[0].base_global_rank == 0
    assert second[0].base_global_rank == first[1]
    assert (a.master_addr, a.master_port) == (b.master_addr, b.master_port)

    # Alone at the barrier, a node gives up after its timeout and reports it.
    started = time.monotonic()
    assert not await host.exit_barrier(0.5)
    assert time.monotonic() - started < 10
    assert await peer.exit_barrier(5.0)
    await peer.aclose(shutdown=False)
    await host.aclose()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_cancelled_join_returns_at_once_and_later_calls_queue_behind_it() -> None:
    handler = await create_rdzv_handler(
        "c10d",
        f"127.0.0.1:{free_port()}",
        "lonely",
        2,
        2,
        local_addr="127.0.0.1",
        join_timeout=3,
    )
    rdzv = Rendezvous(handler, owned=True)
    started = time.monotonic()
    with anyio.move_on_after(0.5) as scope:
        await rdzv.next_rendezvous("trainer", 1)  # needs a second node that never comes
    assert scope.cancelled_caught
    assert time.monotonic() - started < 2.0
    # The abandoned join still owns the handler until torch's join timeout; the next call
    # waits for it instead of racing it inside torch's non-thread-safe handler.
    assert await rdzv.num_nodes_waiting() == 0
    assert time.monotonic() - started >= 3.0
    await rdzv.aclose()


@pytest.mark.timeout(60)
def test_an_abandoned_join_does_not_hold_the_interpreter_at_exit() -> None:
    # Handler calls run on a daemon thread: on a non-daemon one (anyio's worker threads)
    # the process would outlive its event loop until torch's join timeout ran out.
    code = (
        "import sys, anyio\n"
        "from aioelastic._elastic.rendezvous._handlers import create_rdzv_handler\n"
        "from aioelastic._elastic.rendezvous._node import Rendezvous\n"
        "async def main() -> None:\n"
        "    handler = await create_rdzv_handler(\n"
        "        'c10d', sys.argv[1], 'lonely', 2, 2, local_addr='127.0.0.1', join_timeout=300\n"
        "    )\n"
        "    with anyio.move_on_after(0.5):\n"
        "        await Rendezvous(handler).next_rendezvous('trainer', 1)\n"
        "    print('abandoned', flush=True)\n"
        "anyio.run(main)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, f"127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=45,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["abandoned"]


@pytest.mark.asyncio
async def test_misuse_is_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="min_nodes <= max_nodes"):
        await create_rdzv_handler("c10d", "localhost:0", "x", 2, 1)
    with pytest.raises(TypeError, match="min_nodes must be an int"):
        await create_rdzv_handler("c10d", "localhost:0", "x", "1", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend"):
        await create_rdzv_handler("", "localhost:0", "x", 1, 1)
    with pytest.raises(ValueError, match="run_id"):
        await create_rdzv_handler("c10d", "localhost:0", "", 1, 1)
    with pytest.raises(TypeError, match="RendezvousHandler"):
        Rendezvous(object())  # type: ignore[arg-type]
    # torch's own validation still applies, raised from the creating thread.
    with pytest.raises(ValueError, match="not registered"):
        await create_rdzv_handler("no-such-backend", "localhost:0", "x", 1, 1)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_an_unreachable_store_names_its_reason_and_keeps_it_as_the_cause() -> None:
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    port = free_port()  # nothing listens there
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as info:
        await create_rdzv_handler(
            "c10d", f"127.0.0.1:{port}", "job", 1, 2, is_host=False, read_timeout=1
        )
    assert time.monotonic() - started < 30
    assert isinstance(info.value.__cause__, DistNetworkError)
    assert str(info.value).startswith("The connection to the C10d store has failed.")
    assert f"(DistNetworkError: {info.value.__cause__}" in str(info.value)
    assert f"(127.0.0.1, {port})" in str(info.value)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_node_joining_a_later_round_gets_the_worker_store_of_rank_0() -> None:
    # torch 2.13 alone: the late node blocks in next_rendezvous until its store read times
    # out, because rank 0 publishes the worker store only in the first round it hosts.
    endpoint = f"127.0.0.1:{free_port()}"
    conf = {"join_timeout": 30, "last_call_timeout": 1, "read_timeout": 20}
    first = Rendezvous(
        await create_rdzv_handler(
            "c10d", endpoint, "grow", 1, 2, local_addr="127.0.0.1", is_host=True, **conf
        ),
        owned=True,
    )
    alone = await joined(first, "trainer", 2)
    assert (alone.group_world_size, alone.world_size) == (1, 2)
    late = Rendezvous(
        await create_rdzv_handler(
            "c10d", endpoint, "grow", 1, 2, local_addr="127.0.0.1", is_host=False, **conf
        ),
        owned=True,
    )
    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        late_outcomes: list[RendezvousOutcome] = []

        async def join_late() -> None:
            late_outcomes.append(await joined(late, "trainer", 2))

        tg.start_soon(join_late)
        while await first.num_nodes_waiting() == 0:
            await anyio.sleep(0.1)
        grown = await joined(first, "trainer", 2)
    assert time.monotonic() - started < 15
    assert (grown.group_world_size, grown.world_size) == (2, 4)
    assert late_outcomes[0].world_size == 4
    assert (late_outcomes[0].master_addr, late_outcomes[0].master_port) == (
        grown.master_addr,
        grown.master_port,
    )
    await late.aclose(shutdown=False)
    await first.aclose()


@pytest.mark.asyncio
async def test_a_spare_node_told_to_leave_is_not_an_error() -> None:
    rdzv = Rendezvous(SpareNodeHandler())
    assert await rdzv.next_rendezvous("trainer", 1) is None
    await rdzv.aclose()


@pytest.mark.asyncio
async def test_one_node_without_an_agent_store_needs_no_rendezvous_at_all() -> None:
    local = LocalRendezvous("solo", local_addr="127.0.0.1")
    assert (local.use_agent_store, local.membership_can_change) == (False, False)
    first = await local.next_rendezvous("trainer", 3)
    again = await local.next_rendezvous("trainer", 3)
    assert (first.group_rank, first.group_world_size, first.world_size) == (0, 1, 3)
    assert first.master_addr == "127.0.0.1"
    assert first.master_port != again.master_port  # a new worker store every attempt
    assert await local.num_nodes_waiting() == 0
    assert await local.exit_barrier(1.0)
    assert LocalRendezvous().run_id != LocalRendezvous().run_id


@pytest.mark.parametrize(
    "endpoint",
    ["node0:29400", "127.0.0.1:0", "localhost", "[::1]:29500", "[::1]", ":1234", "", "host:",
     "host:x", "host:70000", "[::1", "::1", "a b:1", "host:+80", "host:0080", "[h]:1:2",
     "h:123456", " node0:1 "],
)  # fmt: skip
def test_endpoints_parse_as_torch_parses_them_without_importing_it(endpoint: str) -> None:
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    def outcome(parse: Any) -> object:
        try:
            return parse(endpoint, 29400)
        except ValueError:
            return ValueError

    assert outcome(parse_endpoint) == outcome(
        lambda e, p: parse_rendezvous_endpoint(e, default_port=p)
    )


# -- the options of torch's own backends ------------------------------------------------

# Where each of torch's own backends reads its options (torch/distributed/elastic/rendezvous).
_READ_BY = {
    "c10d": ("c10d_rendezvous_backend.py", "dynamic_rendezvous.py"),
    "etcd-v2": ("etcd_rendezvous_backend.py", "dynamic_rendezvous.py"),
    "etcd": ("etcd_rendezvous.py",),
    "static": ("static_tcp_rendezvous.py",),
}
_OPTION_READS = (
    re.compile(r'params\.(?:config\.)?get(?:_as_int|_as_bool)?\(\s*"(\w+)"'),
    re.compile(r'params\.config\["(\w+)"\]'),
)
_TIMEOUT_READS = re.compile(r'_get_timeout\(params, "(\w+)"\)')  # reads <name>_timeout


def test_the_options_checked_are_those_torchs_backends_read() -> None:
    import inspect

    from torch.distributed.elastic.rendezvous import registry

    folder = Path(torch_rendezvous.__file__).parent
    defaults = inspect.getsource(registry._register_default_handlers)
    registered = re.findall(r'register\("([\w-]+)"', defaults)
    assert sorted(registered) == sorted(RDZV_OPTIONS) == sorted(_READ_BY)
    for backend, files in _READ_BY.items():
        source = "".join((folder / name).read_text() for name in files)
        read = {key for pattern in _OPTION_READS for key in pattern.findall(source)}
        read |= {f"{name}_timeout" for name in _TIMEOUT_READS.findall(source)}
        assert set(RDZV_OPTIONS[backend]) == read, backend


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_bad_options_are_refused_before_the_store_is_made() -> None:
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    with pytest.raises(ValueError, match=r"^join_timeout=-5 is not a whole number of seconds"):
        await create_rdzv_handler("c10d", endpoint, "job", 1, 2, is_host=True, join_timeout=-5)
    with pytest.raises(ValueError, match=r"^'heartbeat' is not an option of torch's c10d"):
        await create_rdzv_handler("c10d", endpoint, "job", 1, 2, is_host=True, heartbeat=5)
    with pytest.raises(ValueError, match=r"^is_host='maybe' is not a boolean"):
        await create_rdzv_handler("c10d", endpoint, "job", 1, 2, is_host="maybe")
    with pytest.raises(ValueError, match=r"^rank=-1 is not a whole number >= 0"):
        await create_rdzv_handler("static", endpoint, "job", 2, 2, rank=-1)
    # No store was hosted on the port (torch's own check comes after it is up).
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    # What torch's LaunchConfig gives every backend, and what torch reads as None or text.
    handler = await create_rdzv_handler(
        "c10d", endpoint, "job", 1, 1, timeout=900, join_timeout=None, is_host="yes",
        read_timeout="20", keep_alive_max_attempt=3.0, store_type=" TCP ",
    )  # fmt: skip
    await Rendezvous(handler, owned=True).aclose()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_backend_registered_by_the_user_gets_its_options_as_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    seen: list[dict[str, Any]] = []

    class Mine(SpareNodeHandler):
        def get_backend(self) -> str:
            return "aioelastic-test"

    def create(params: Any) -> Mine:
        seen.append(dict(params.config))
        return Mine()

    monkeypatch.setitem(rendezvous_handler_registry._registry, "aioelastic-test", create)
    options = {"join_timeout": -5, "timeout": "abc", "heartbeat": "x"}
    # The same options as for c10d, which refuses them.
    with pytest.raises(ValueError, match="join_timeout=-5"):
        await create_rdzv_handler("c10d", "127.0.0.1:0", "job", 1, 1, **options)
    await create_rdzv_handler("aioelastic-test", "127.0.0.1:0", "job", 1, 1, **options)
    assert seen == [options]


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
async def test_an_etcd_backend_without_its_client_names_the_package_to_install(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    from aioelastic import create_rdzv_handler

    # The client is installed here (the dev extra): its absence is what is simulated.
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "etcd" else real(name, *a)
    )
    with pytest.raises(RuntimeError, match=r"pip install 'aioelastic\[etcd\]'"):
        await create_rdzv_handler(backend, "127.0.0.1:2379", "job", 1, 1)
