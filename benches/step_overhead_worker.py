"""Runs 256 greedy requests through whichever aieng is importable and times each engine step,
split into the model's forward, the LM head, and everything else (scheduling, input
preparation, sampling, output processing). Prints one JSON object. Used by
bench_step_overhead.py, which runs it against this tree and against an earlier design.

    python benches/step_overhead_worker.py CHECKPOINT [--requests 256] [--output-len 96]
"""

import argparse
import json
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import aieng
    from aieng import LLM, SamplingParams

    llm = LLM(
        args.checkpoint,
        max_num_seqs=args.requests,
        max_num_batched_tokens=16384,
        kv_cache_memory=1 << 30,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    model = engine.runner.model
    spent = {"forward": 0.0, "logits": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            spent[name] += time.perf_counter() - start
            return out

        return wrapper

    model.forward = timed("forward", model.forward)
    model.compute_logits = timed("logits", model.compute_logits)
    rng = np.random.default_rng(0)
    lengths = rng.integers(16, 65, size=args.requests)
    prompts = [rng.integers(10, 32000, size=int(n)).tolist() for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    rows = []
    while engine.has_unfinished():
        spent["forward"] = spent["logits"] = 0.0
        start = time.perf_counter()
        engine.step()
        total = time.perf_counter() - start
        if engine.last_step_num_tokens == args.requests:  # a step of 256 decodes
            rows.append((total, spent["forward"], spent["logits"]))
    steps = np.array(rows) * 1e6  # µs
    total, forward, logits = steps[:, 0], steps[:, 1], steps[:, 2]
    other = total - forward - logits
    print(
        json.dumps(
            {
                "aieng": str(aieng.__file__),
                "decode_steps": len(rows),
                "step_us_p50": float(np.median(total)),
                "forward_us_p50": float(np.median(forward)),
                "logits_us_p50": float(np.median(logits)),
                "outside_forward_us_p50": float(np.median(other)),
                "outside_forward_us_mean": float(other.mean()),
            }
        )
    )


if __name__ == "__main__":
    main()
