"""Defaults of `aieng quantize`, importable without torch (the CLI's help reads them)."""

DEFAULT_NUM_SAMPLES = 128  # calibration sequences
DEFAULT_SEQ_LEN = 512  # tokens per calibration sequence (at most the model's context)
