"""A small, seeded English corpus and a seconds-long training run for the training tests."""

import random
from pathlib import Path

from aieng.train.trainer import TrainConfig, train

SUBJECTS = ["the king", "a shepherd", "the people", "his servant", "the prophet", "my son"]
VERBS = ["went up to", "spake unto", "looked upon", "departed from", "came into", "blessed"]
OBJECTS = ["the city", "the river", "the mountain", "Jerusalem", "the temple", "the field"]
ENDINGS = [".", ", and it was so.", "; and he was glad.", " in the morning.", " by night."]


def write_corpus(path: Path, documents: int, seed: int) -> Path:
    rng = random.Random(seed)
    docs = []
    for _ in range(documents):
        lines = [
            f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
            f"{rng.choice(ENDINGS)}"
            for _ in range(rng.randint(3, 8))
        ]
        docs.append("\n".join(lines))
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def tiny_config(folder: Path, **overrides) -> TrainConfig:
    folder.mkdir(parents=True, exist_ok=True)
    data = write_corpus(folder / "train.txt", 120, seed=1)
    heldout = write_corpus(folder / "heldout.txt", 12, seed=2)
    settings = dict(
        data=str(data),
        heldout=str(heldout),
        out=str(folder / "model"),
        vocab_size=320,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        seq_len=64,
        batch_size=8,
        steps=40,
        lr=3e-3,
        warmup_steps=5,
        eval_interval=20,
        eval_windows=8,
        checkpoint_interval=20,
        log_interval=10,
        threads=1,
    )
    settings.update(overrides)
    return TrainConfig(**settings)


def train_tiny(folder: Path, **overrides):
    return train(tiny_config(folder, **overrides))
