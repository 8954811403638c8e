"""Runs bench_offline's aieng workload with whichever aieng is importable and prints the run as
JSON — bench_offline.py starts it with PYTHONPATH pointing at an earlier design's install, so
both designs are measured in one run on the same checkpoint.

    PYTHONPATH=/tmp/prev_site python benches/previous_design_worker.py CHECKPOINT REQUESTS \
        KV_BYTES MAX_NUM_BATCHED_TOKENS MAX_NUM_SEQS REPS
"""

import json
import sys

import torch


def main() -> None:
    folder, requests, kv_bytes, batched, seqs, reps = sys.argv[1:7]
    torch.set_num_threads(2)
    import aieng
    from aieng.benchmarks.offline import run_aieng, workload

    prompts, output_lens = workload(int(requests), 32000)
    run = run_aieng(
        folder, prompts, output_lens, kv_cache_memory=int(kv_bytes),
        max_num_batched_tokens=int(batched), max_num_seqs=int(seqs), reps=int(reps),
    )  # fmt: skip
    print(
        json.dumps(
            {
                "aieng": aieng.__file__,
                "tokens": run.tokens,
                "wall_s": run.wall_s,
                "walls_s": run.walls_s,
                "token_ids": run.token_ids,
            }
        )
    )


if __name__ == "__main__":
    main()
