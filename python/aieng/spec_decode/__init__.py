"""Speculative decoding, the engine's side: proposers guess the next tokens of a request, one
target forward checks them all (`aieng.worker.spec_verify`), and the output is exactly what plain
decoding would give.

`aieng.config.speculative` reads `speculative_config`; `proposer.py` is the interface every
proposer meets; `ngram.py` is prompt lookup; `draft_proposer.py` asks the runner's draft model
(`aieng.worker.draft_model`); `drafts.py` holds a step's proposals. The Rust core schedules a
decoding row's drafts after its last token (`EngineCore.set_draft`) and counts as computed only
what the verification accepts.
"""
