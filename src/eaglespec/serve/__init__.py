"""`eaglespec serve`: an OpenAI-compatible HTTP server over the engine.

app.py      routes: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics, / (chat page)
schemas.py  request bodies (pydantic) and the OpenAI-style error
worker.py   the engine thread: submits, cancels and steps; hands tokens to handlers
metrics.py  Prometheus counters, gauges and histograms (names after vLLM's)
cli.py      the command's options and start-up
page/       the chat page (plain HTML and JS)
"""
