"""Tokenizer throughput of aieng's Rust tokenizer against the Python `tokenizers` package.

1. Encode: `Tokenizer.encode_batch` over 10,000 synthetic mixed-script documents (200-2000
   chars each, seed 0) against `tokenizers.Tokenizer.encode_batch` on the same tokenizer.json,
   both as their users run them: no environment variable set (each library's rayon pool has its
   default, one thread per core), best of --repeats. Reports docs/s and MB/s.
2. Detokenize: µs per generated token of the core's incremental detokenizer, measured as
   `EngineCore.schedule()+update()` with a tokenizer minus the same loop without one, against
   re-decoding the whole output each step with `tokenizers` (`tok.decode(ids[:k])` for each k),
   for outputs of 128, 512 and 2048 tokens.

Tokenizers: a Llama-3 style byte-level BPE and a Llama-2 style SentencePiece BPE with byte
fallback, both trained here (vocab 8192) on part of the corpus.

    .venv/bin/python benches/bench_tokenizer.py [--docs 10000] [--repeats 3] [--out benches/results]
"""

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers

import aieng
from aieng.core import EngineCore, Tokenizer

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
OUTPUT_LENGTHS = (128, 512, 2048)

# ------------------------------------------------------------------ corpus


def word_list(rng: random.Random, n: int = 3000) -> list[str]:
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w"]
    onsets += ["br", "ch", "cl", "dr", "gr", "pl", "sh", "st", "th", "tr", "str"]
    vowels = ["a", "e", "i", "o", "u", "ea", "ou", "ai", "é", "ö", "ü", "å"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "ng", "st", "ck"]
    words = set()
    while len(words) < n:
        syllables = rng.choices([1, 2, 3, 4], weights=[4, 5, 3, 1])[0]
        words.add(
            "".join(
                rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                for _ in range(syllables)
            )
        )
    return sorted(words)


SNIPPETS = [
    "日本語のテキストと中文文本。",
    "北京是中国的首都，东京是日本的首都。",  # noqa: RUF001
    "서울은 한국의 수도입니다.",
    "Русский текст: привет, мир!",
    "Ελληνικά: αβγδε.",
    "العربية تكتب من اليمين إلى اليسار.",
    "မြန်မာဘာသာ ဖြစ်ပါသည်။",
    "emoji 🙂👍🏽 ❤️ 👨‍👩‍👧‍👦 🏳️‍🌈",
    "def f(x):\n    return x * 2\n",
    "3.14159, 2,718 and 1e-9;",
    "\t- item one\n\t- item two\n",
]


def make_documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = word_list(rng)
    weights = [1.0 / (i + 10) for i in range(len(words))]  # Zipf-like
    docs = []
    for _ in range(n):
        target = rng.randint(200, 2000)
        parts: list[str] = []
        size = 0
        while size < target:
            if rng.random() < 0.12:
                piece = rng.choice(SNIPPETS)
            else:
                sentence = rng.choices(words, weights=weights, k=rng.randint(4, 18))
                piece = " ".join(sentence).capitalize() + rng.choice([".", ".", ",", "?", "!"])
            parts.append(piece)
            size += len(piece) + 1
        docs.append(" ".join(parts)[:target])
    return docs


# ------------------------------------------------------------------ tokenizers


def train_bytelevel(corpus: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def train_spm(corpus: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS + [f"<0x{b:02X}>" for b in range(256)],
        show_progress=False,
        limit_alphabet=300,
        max_token_length=16,
    )
    tok.train_from_iterator(corpus, trainer)
    data = json.loads(tok.to_str())  # byte tokens are plain vocabulary, as in Llama-2
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in SPECIALS]
    return tokenizers.Tokenizer.from_str(json.dumps(data))


# ------------------------------------------------------------------ measurements


def best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_encode(ours: Tokenizer, ref: tokenizers.Tokenizer, docs: list[str], repeats: int):
    n_bytes = sum(len(d.encode()) for d in docs)
    ours_ids = ours.encode_batch(docs, add_special_tokens=False)
    ref_ids = [e.ids for e in ref.encode_batch(docs, add_special_tokens=False)]
    mismatches = sum(a != b for a, b in zip(ours_ids, ref_ids, strict=True))
    n_tokens = sum(len(i) for i in ours_ids)
    rows = []
    for name, fn in [
        ("aieng encode_batch", lambda: ours.encode_batch(docs, add_special_tokens=False)),
        ("tokenizers encode_batch", lambda: ref.encode_batch(docs, add_special_tokens=False)),
    ]:
        seconds = best_of(repeats, fn)
        rows.append(
            {
                "impl": name,
                "seconds": seconds,
                "docs_per_s": len(docs) / seconds,
                "mb_per_s": n_bytes / seconds / 1e6,
                "tokens_per_s": n_tokens / seconds,
            }
        )
    return rows, {"bytes": n_bytes, "tokens": n_tokens, "mismatched_docs": mismatches}


def drive_core(tok: Tokenizer | None, outputs: list[list[int]]) -> float:
    """Seconds to stream every output (one request each, side by side) through EngineCore."""
    n = max(len(o) for o in outputs)
    core = EngineCore(
        num_blocks=len(outputs) * (n // 16 + 2),
        block_size=16,
        max_num_seqs=len(outputs),
        max_model_len=n + 16,
        tokenizer=tok,
    )
    for i, ids in enumerate(outputs):
        core.add_request(f"r{i}", [1], max_tokens=len(ids), ignore_eos=True)
    columns = np.array(outputs, dtype=np.int64)  # all outputs have the same length here
    index = {f"r{i}": i for i in range(len(outputs))}
    step = 0
    start = time.perf_counter()
    while core.has_unfinished():
        plan = core.schedule()
        rows = [index[plan.request_ids[int(r)]] for r in plan.sample_request_rows]
        out = core.update(columns[rows, step])
        _ = out.texts
        step += 1
    return time.perf_counter() - start


def bench_detokenize(ours: Tokenizer, ref: tokenizers.Tokenizer, docs: list[str], repeats: int):
    stream = [i for ids in ours.encode_batch(docs[:800], add_special_tokens=False) for i in ids]
    rows = []
    for length in OUTPUT_LENGTHS:
        n_requests = max(16, 16384 // length)
        outputs = [stream[i * length : (i + 1) * length] for i in range(n_requests)]
        assert all(len(o) == length for o in outputs)
        tokens = n_requests * length
        drive_core(ours, outputs[:4])  # warm-up
        with_tok = best_of(repeats, lambda o=outputs: drive_core(ours, o))
        without = best_of(repeats, lambda o=outputs: drive_core(None, o))

        redecode_outputs = outputs[: max(1, 4096 // length)]

        def redecode(outs=redecode_outputs):
            for ids in outs:
                for k in range(1, len(ids) + 1):
                    ref.decode(ids[:k])

        redecode_s = best_of(max(1, repeats // 2), redecode)
        redecode_tokens = sum(len(o) for o in redecode_outputs)
        rows.append(
            {
                "output_tokens": length,
                "requests": n_requests,
                "core_step_with_tokenizer_us_per_token": with_tok / tokens * 1e6,
                "core_step_without_tokenizer_us_per_token": without / tokens * 1e6,
                "aieng_incremental_us_per_token": max(0.0, with_tok - without) / tokens * 1e6,
                "tokenizers_redecode_us_per_token": redecode_s / redecode_tokens * 1e6,
            }
        )
    return rows


# ------------------------------------------------------------------ report


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()

    docs = make_documents(args.docs)
    machine = {
        "nproc": os.cpu_count(),
        "cpu": cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "aieng": aieng.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
        # Recorded, never set: a variable here changes how a library runs.
        "environment": {
            name: os.environ.get(name) for name in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM")
        },
    }
    results = {"machine": machine, "docs": len(docs), "vocab_size": args.vocab, "encode": {}}
    results["detokenize"] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, train in [("byte-level BPE", train_bytelevel), ("SentencePiece BPE", train_spm)]:
            path = Path(tmp) / f"{kind.split()[0]}.json"
            train(docs[:2000], args.vocab).save(str(path))
            ours, ref = Tokenizer.from_file(path), tokenizers.Tokenizer.from_file(str(path))
            rows, info = bench_encode(ours, ref, docs, args.repeats)
            results["encode"][kind] = {"rows": rows, **info}
            results["detokenize"][kind] = bench_detokenize(ours, ref, docs, args.repeats)
            print(f"{kind}: done", file=sys.stderr)

    md = render(results)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_tokenizer.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "bench_tokenizer.md").write_text(md)


def render(results: dict) -> str:
    m = results["machine"]
    lines = [
        "# bench_tokenizer",
        "",
        f"{results['docs']} synthetic mixed-script documents (200-2000 chars, seed 0), "
        f"tokenizers trained here with vocab {results['vocab_size']}, add_special_tokens=False, "
        f"both libraries with their defaults (environment: {m['environment']}; rayon's pool: "
        f"one thread per core), best of the repeats.",
        "",
        f"Machine: {m['nproc']} cores ({m['cpu']}), {m['platform']}, python {m['python']}, "
        f"aieng {m['aieng']}, tokenizers {m['tokenizers']}, numpy {m['numpy']}.",
        "",
        "## Encode",
        "",
        "| tokenizer | impl | seconds | docs/s | MB/s | tokens/s | ids identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, enc in results["encode"].items():
        same = "yes" if enc["mismatched_docs"] == 0 else f"no ({enc['mismatched_docs']} docs)"
        for r in enc["rows"]:
            lines.append(
                f"| {kind} | {r['impl']} | {r['seconds']:.3f} | {r['docs_per_s']:,.0f} | "
                f"{r['mb_per_s']:.2f} | {r['tokens_per_s']:,.0f} | {same} |"
            )
    lines += [
        "",
        "## Detokenize (µs per generated token)",
        "",
        "aieng incremental = (schedule+update with a tokenizer) - (the same without), "
        "max(16, 16384 / length) requests side by side; "
        "tokenizers re-decode = `decode(ids[:k])` for every k.",
        "",
        "| tokenizer | output tokens | core step w/ tokenizer | core step w/o | "
        "aieng incremental | tokenizers re-decode | speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, rows in results["detokenize"].items():
        for r in rows:
            inc = r["aieng_incremental_us_per_token"]
            red = r["tokenizers_redecode_us_per_token"]
            speedup = f"{red / inc:,.0f}x" if inc > 0 else "n/a"
            lines.append(
                f"| {kind} | {r['output_tokens']} | "
                f"{r['core_step_with_tokenizer_us_per_token']:.2f} | "
                f"{r['core_step_without_tokenizer_us_per_token']:.2f} | {inc:.2f} | "
                f"{red:.1f} | {speedup} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
