"""/metrics parses as Prometheus text, and its counters equal what the requests made report."""

from __future__ import annotations

import requests

from serve_helpers import PROMPTS, load_spec, metric_samples, oracle_engine, running_server, sse_events


def test_metrics_match_requests(tiny_chat_checkpoint_256):
    with running_server(oracle_engine(load_spec(tiny_chat_checkpoint_256))) as srv:
        url, model = srv.url, srv.model
        assert metric_samples(requests.get(url + "/metrics", timeout=5).text)  # parses before any request
        reports, usages = [], []
        for i, (prompt, method) in enumerate(zip(PROMPTS[:6], ["vanilla", "eagle2", "eagle", "eagle2", "vanilla",
                                                               "eagle2"])):
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 10 + 3 * i,
                    "temperature": 0.7 if i % 2 else 0.0, "seed": i, "eaglespec": {"method": method}}
            if i % 2:
                body.update(stream=True, stream_options={"include_usage": True})
                with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=30) as r:
                    events = sse_events(r)
                usages.append(events[-2]["usage"])
                reports.append(events[-3]["eaglespec"])
            else:
                out = requests.post(url + "/v1/chat/completions", json=body, timeout=30).json()
                usages.append(out["usage"])
                reports.append(out["eaglespec"])
        bad = requests.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": -1},
                            timeout=5)
        assert bad.status_code == 400

        m = metric_samples(requests.get(url + "/metrics", timeout=5).text)
        name = ("model_name", model)

        def value(metric: str, *labels) -> float:
            return m.get((metric, name, *labels), 0.0)

        assert value("eaglespec:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
        assert value("eaglespec:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
        assert value("eaglespec:prompt_tokens_cached_total") == sum(u["prompt_tokens_details"]["cached_tokens"]
                                                                    for u in usages)
        assert value("eaglespec:requests_total", ("status", "finished")) == 6
        assert value("eaglespec:requests_total", ("status", "rejected")) == 1
        spec = [r for r in reports if r["method"] != "vanilla"]
        assert value("eaglespec:spec_decode_num_drafts_total") == sum(r["steps"] for r in spec)
        assert value("eaglespec:spec_decode_num_draft_tokens_total") == sum(r["draft_tokens"] for r in reports)
        accepted = sum(r["accepted_tokens"] for r in reports)
        assert accepted > 0 and value("eaglespec:spec_decode_num_accepted_tokens_total") == accepted
        per_pos = [sum(r["accepted_per_position"][d] for r in reports if d < len(r["accepted_per_position"]))
                   for d in range(max(len(r["accepted_per_position"]) for r in reports))]
        got_pos = [value("eaglespec:spec_decode_num_accepted_tokens_per_pos_total", ("position", str(d)))
                   for d in range(len(per_pos))]
        assert got_pos == per_pos and sum(per_pos) == accepted
        assert value("eaglespec:time_to_first_token_seconds_count") == 6
        assert value("eaglespec:time_per_output_token_seconds_count") == 6
        assert value("eaglespec:e2e_request_latency_seconds_count") == 6
        assert value("eaglespec:num_requests_running") == 0 and value("eaglespec:num_requests_waiting") == 0
