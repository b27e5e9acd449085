"""The real training script of the launcher measure: torch, a gloo process group, a barrier.

Run by ``torchrun`` / ``aioelastic-run`` as a script, so it imports nothing from the
project: ``python benchmarks/programs/_gloo.py DIR [fail-once]`` imports torch, joins the job's
process group (``init_process_group("gloo")`` from the launcher's environment), passes a
barrier and then writes ``DIR/start{LOCAL_RANK}``: the moment this rank is past the barrier.

With ``fail-once``, attempt 0 (``TORCHELASTIC_RESTART_COUNT=0``) does not stamp: past the
barrier, rank 0 writes ``DIR/fail`` and exits 1 while the other ranks keep running (as in
training), so the launcher must stop them and restart the job; attempt 1 stamps as above.
"""

import os
import sys
import time

import torch.distributed as dist

#: How long a surviving rank of attempt 0 waits to be stopped; only a broken launcher
#: lets it run that long.
_SURVIVOR_TTL_S = 300.0


def _stamp(path: str) -> None:
    stamp = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    with open(path, "w") as f:
        f.write(str(stamp))


def main() -> None:
    """Join the group, pass the barrier, write this rank's stamp (or fail, see above)."""
    directory = sys.argv[1]
    fail_once = sys.argv[2:] == ["fail-once"]
    dist.init_process_group("gloo")
    dist.barrier()
    if fail_once and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        if os.environ["RANK"] == "0":
            _stamp(os.path.join(directory, "fail"))
            os._exit(1)
        time.sleep(_SURVIVOR_TTL_S)
        os._exit(2)
    _stamp(os.path.join(directory, "start" + os.environ["LOCAL_RANK"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
