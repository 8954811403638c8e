"""The engine: `llm_engine` (the step loop over the Rust core), the async engine for servers,
`EngineClient` (the protocol every front end talks to) and LLM.embed's offline loop."""
