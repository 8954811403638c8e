"""The hand-written autograd (aieng.scratch, numpy) against torch on one MLP training step:
zero_grad, forward and cross-entropy, backward, Adam step, in float64 on one CPU thread (numpy's
BLAS and torch both), for a few network and batch sizes. Reports µs per step, split into the
three phases, best of --repeats; and, as a check that the two compute the same thing, the
2-64-2 spiral network trained by both from the same weights on the same batches (largest loss
difference over the run, final accuracy).

    .venv/bin/python benches/bench_scratch_autograd.py [--steps 100] [--repeats 3] [--quick]

Writes benches/results/bench_scratch_autograd.{md,json} (not with --quick, unless --out).
"""

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from aieng.benchmarks.offline import machine
from aieng.scratch import MLP, Adam, Tensor, cross_entropy, no_grad, spirals

# (layer sizes, batch)
CONFIGS = [((2, 64, 2), 32), ((2, 64, 2), 256), ((784, 256, 10), 128), ((784, 1024, 10), 256)]
PHASES = ("forward", "backward", "step")
Step = Callable[[], tuple[float, float, float]]


def torch_copy(model: MLP) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for layer in model.layers:
        linear = torch.nn.Linear(*reversed(layer.weight.shape), dtype=torch.float64)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(layer.weight.data))
            linear.bias.copy_(torch.from_numpy(layer.bias.data))
        layers += [linear, torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def scratch_step(model: MLP, x: np.ndarray, y: np.ndarray) -> Step:
    opt = Adam(model.parameters(), lr=1e-3)

    def step() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = cross_entropy(model(Tensor(x)), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    return step


def torch_step(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> Step:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)

    def step() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(tx), ty)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    return step


def time_steps(step: Step, steps: int, repeats: int) -> dict[str, float]:
    """µs per step in each phase, from the repeat with the smallest total."""
    for _ in range(max(3, steps // 10)):
        step()
    best: np.ndarray | None = None
    for _ in range(repeats):
        phases = np.mean([step() for _ in range(steps)], axis=0) * 1e6
        if best is None or phases.sum() < best.sum():
            best = phases
    assert best is not None
    return {**dict(zip(PHASES, best.tolist(), strict=True)), "total": float(best.sum())}


def bench_config(sizes: tuple[int, ...], batch: int, steps: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    model = MLP(sizes, rng)
    reference = torch_copy(model)
    x, y = rng.normal(size=(batch, sizes[0])), rng.integers(0, sizes[-1], batch)
    ours = time_steps(scratch_step(model, x, y), steps, repeats)
    theirs = time_steps(torch_step(reference, x, y), steps, repeats)
    return {"sizes": list(sizes), "batch": batch, "scratch_us": ours, "torch_us": theirs}


def training_parity(steps: int) -> dict:
    """The test's run (tests/test_scratch_mlp.py): 2-64-2 tanh, Adam, batches of 32."""
    rng = np.random.default_rng(0)
    points, labels = spirals(per_class=100, classes=2, rng=rng)
    model = MLP((2, 64, 2), rng)
    reference = torch_copy(model)
    opt, topt = Adam(model.parameters(), lr=0.02), torch.optim.Adam(reference.parameters(), lr=0.02)
    tpoints, tlabels = torch.from_numpy(points), torch.from_numpy(labels)
    worst = 0.0
    for _ in range(steps):
        rows = rng.choice(len(points), 32, replace=False)
        opt.zero_grad()
        loss = cross_entropy(model(Tensor(points[rows])), labels[rows])
        loss.backward()
        opt.step()
        topt.zero_grad()
        tloss = torch.nn.functional.cross_entropy(reference(tpoints[rows]), tlabels[rows])
        tloss.backward()
        topt.step()
        worst = max(worst, abs(loss.item() - tloss.item()))
    with no_grad():
        accuracy = float((model(Tensor(points)).data.argmax(axis=1) == labels).mean())
    with torch.no_grad():
        torch_accuracy = float((reference(tpoints).argmax(dim=1).numpy() == labels).mean())
    return {
        "steps": steps,
        "max_loss_difference": worst,
        "accuracy": accuracy,
        "torch_accuracy": torch_accuracy,
    }


def report(results: list[dict], parity: dict, info: dict) -> str:
    lines = [
        "# bench_scratch_autograd",
        "",
        f"Machine: {info['nproc']} CPUs ({info['cpu']}), torch {info['torch']}, numpy "
        f"{np.__version__}, Python {info['python']}; one thread (torch.set_num_threads(1), "
        f"BLAS threads 1 through threadpoolctl); float64; Adam; tanh.",
        "",
        "| network | batch | scratch µs/step (fwd / bwd / step) | torch µs/step (fwd / bwd / step) "
        "| scratch / torch |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        ours, theirs = r["scratch_us"], r["torch_us"]
        split = lambda t: " / ".join(f"{t[p]:.0f}" for p in PHASES)  # noqa: E731
        lines.append(
            f"| {'-'.join(map(str, r['sizes']))} | {r['batch']} | {ours['total']:.0f} "
            f"({split(ours)}) | {theirs['total']:.0f} ({split(theirs)}) "
            f"| {ours['total'] / theirs['total']:.2f}x |"
        )
    lines += [
        "",
        f"Training check (2-64-2 on spirals, {parity['steps']} Adam steps): largest loss "
        f"difference from torch {parity['max_loss_difference']:.1e}; final accuracy "
        f"{parity['accuracy']:.3f} (torch {parity['torch_accuracy']:.3f}).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a few steps, to check that it runs")
    ap.add_argument("--out", default=None, help="folder for the results (default: results/)")
    args = ap.parse_args()
    # One thread for both, set through each library's own API (no environment variable):
    # torch's intra-op pool, and numpy's BLAS pool through threadpoolctl.
    torch.set_num_threads(1)
    steps, repeats = (10, 1) if args.quick else (args.steps, args.repeats)
    with threadpool_limits(limits=1, user_api="blas"):
        results = [bench_config(sizes, batch, steps, repeats) for sizes, batch in CONFIGS]
        parity = training_parity(50 if args.quick else 400)
    info = machine(1)
    text = report(results, parity, info)
    print(text)
    out = args.out or (None if args.quick else str(Path(__file__).parent / "results"))
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "bench_scratch_autograd.md").write_text(text)
        payload = {"machine": info, "results": results, "training": parity}
        (folder / "bench_scratch_autograd.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
