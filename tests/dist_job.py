"""A rank of a real `epirl train` torchrun job with one fault injected on one rank (test harness, not a mock:
everything else is the real CLI, engine, trainer and collectives).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist_job.py FAULT RANK STAMP -- train ...

FAULT: `raise` (the rank raises in its first generation, while the others wait in a collective; the time of
the raise goes to the file STAMP), `diverge` (the rank's adapter is nudged once it exists, so the ranks'
adapters differ at the first checksum) or `none`.
"""

import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def inject(fault: str, stamp: str) -> None:
    import torch

    from epirl.rl import loop

    if fault == "raise":
        def failing_generate(*args, **kwargs):
            with open(stamp, "w") as fh:
                fh.write(repr(time.time()))
            raise RuntimeError("injected failure on this rank")

        loop.generate_and_grade = failing_generate
    elif fault == "diverge":
        start_run = loop.start_run

        def nudged_start_run(*args, **kwargs):
            run = start_run(*args, **kwargs)
            with torch.no_grad():
                run.policy.lora_parameters()[0].add_(1e-3)
            return run

        loop.start_run = nudged_start_run
    elif fault != "none":
        raise SystemExit(f"unknown fault {fault!r}")


def main() -> int:
    fault, faulty_rank, stamp, separator, *argv = sys.argv[1:]
    assert separator == "--", "usage: dist_job.py FAULT RANK STAMP -- train ..."
    if os.environ.get("RANK") == faulty_rank:
        inject(fault, stamp)
    from epirl.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
