"""Embeddings per second: aieng (`LLM.embed`, through its scheduler) against sentence-transformers
(`SentenceTransformer.encode`) on the same checkpoint, texts and batch sizes, in one run.

The checkpoint: a random-weight BERT of bge-small's shape (12 layers, hidden 384, 12 heads,
intermediate 1536; the bundled KJV model's tokenizer, vocabulary 4096), saved by
sentence-transformers with mean pooling and normalisation (the tokenizer without its chat
template, which sentence-transformers 5 would apply to every text). The texts: the first
--texts verses of the KJV (Debian's bible-kjv). Each batch size embeds every text in batches
of that size, after one warm-up batch; both sides float32 on the CPU with the same torch thread
count, and the outputs are checked equal (cosine >= 0.9999) before timing counts.

    PYTHONPATH=python .venv/bin/python benches/bench_embeddings.py [--texts 256]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from aieng import LLM
from aieng.benchmarks.offline import machine as machine_info
from aieng.config.default_model import default_model_path
from aieng.train.corpus import kjv_raw_text, kjv_verses

BGE_SMALL = dict(
    hidden_size=384, num_hidden_layers=12, num_attention_heads=12, intermediate_size=1536,
    max_position_embeddings=512, vocab_size=4096,
)  # fmt: skip


def build_checkpoint(folder: Path) -> Path:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    hf = folder / "hf"
    hf.mkdir(parents=True)
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(default_model_path() / name, hf / name)
    # Without the chat template: sentence-transformers 5 would wrap each text in it.
    config = json.loads((default_model_path() / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (hf / "tokenizer_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(**BGE_SMALL)).eval().save_pretrained(hf)
    transformer = modules.Transformer(str(hf))
    pooling = modules.Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    st = SentenceTransformer(modules=[transformer, pooling, modules.Normalize()], device="cpu")
    st.save(str(folder / "st"))
    return folder / "st"


def rate(embed, texts: list[str], batch: int) -> tuple[float, np.ndarray]:
    embed(texts[:batch])  # warm-up
    start = time.perf_counter()
    out = np.concatenate([embed(texts[i : i + batch]) for i in range(0, len(texts), batch)])
    return len(texts) / (time.perf_counter() - start), out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--out", default="benches/results")
    args = parser.parse_args()
    from sentence_transformers import SentenceTransformer

    texts = [v.text for v in kjv_verses(kjv_raw_text())[: args.texts]]
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_checkpoint(Path(tmp))
        st = SentenceTransformer(str(folder), device="cpu")
        llm = LLM(str(folder), max_num_seqs=max(args.batches), max_num_batched_tokens=16384)
        rows = []
        for batch in args.batches:
            ours, a = rate(lambda t: np.stack([o.embedding for o in llm.embed(t)]), texts, batch)
            peer, b = rate(lambda t: st.encode(t, batch_size=len(t)), texts, batch)
            cosine = float((a * b).sum(1).min())
            assert cosine >= 0.9999, f"outputs differ at batch {batch}: cosine {cosine}"
            rows.append(
                dict(batch=batch, aieng=ours, sentence_transformers=peer, min_cosine=cosine)
            )
        llm.shutdown()
    info = machine_info(torch.get_num_threads())
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    machine = (
        f"{info['cpu']} ({info['cpu_features']}), {info['nproc']} CPUs, load average {load} "
        "(1, 5, 15 min) at the end"
    )
    lines = [
        f"# bench_embeddings ({args.texts} KJV verses, bge-small-shaped BERT, float32, CPU)",
        "",
        f"Machine: {machine}; torch threads {torch.get_num_threads()}.",
        "",
        "| batch | aieng emb/s | sentence-transformers emb/s | aieng / peer | min cosine |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["aieng"] / r["sentence_transformers"]
        lines.append(
            f"| {r['batch']} | {r['aieng']:.1f} | {r['sentence_transformers']:.1f} | "
            f"{ratio:.2f}x | {r['min_cosine']:.6f} |"
        )
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_embeddings.json").write_text(json.dumps(dict(rows=rows, machine=machine)))
    (out / "bench_embeddings.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
