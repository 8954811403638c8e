"""The options and what they resolve to: `EngineArgs` (every option, once), `EngineConfig` (resolved
once), the model's config (`model_config`, read from config.json through the family parsers in
`model_configs/`), speculative and quantization configs, the bundled default model, manifests."""
