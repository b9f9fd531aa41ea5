"""Host-side requests, the scheduler and the engine that runs them through the batched step."""
