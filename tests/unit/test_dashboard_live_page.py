"""The page of a run still being written (hvtrace_dashboard.live), driven through Dash's own
HTTP endpoints: the live line, the refresh on a new version, the timeline following the newest
steps, a page loaded later getting the new layout, and the Elastic membership table."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

from hvtrace_dashboard.live import LiveFeed
from test_dashboard_figures import _post, hand_made_data, make_spans

TICK_OUTPUTS = [
    ("live-status", "children"),
    ("live-status", "className"),
    ("live-tick", "disabled"),
    ("live-version", "data"),
    ("summary-cards", "children"),
    ("findings", "children"),
    ("header-notes", "children"),
    ("straggler-panel", "children"),
    ("ratio-rank", "figure"),
    ("ratio-steps", "figure"),
    ("tensors", "figure"),
    ("win-start", "max"),
]


def _feed(data) -> LiveFeed:
    look = SimpleNamespace(live=True, quiet_s=0.0, open_streams=2)
    return LiveFeed(SimpleNamespace(close=lambda: None), data, look, make=lambda lk, a: a)


def _publish(feed: LiveFeed, data) -> None:
    """What a refresh does when the files grew."""
    with feed._lock:
        feed._data = data
        feed.version += 1


def _tick(client, shown: dict) -> dict:
    out = "...".join(f"{i}.{p}" for i, p in TICK_OUTPUTS)
    return _post(
        client,
        f"..{out}..",
        [{"id": i, "property": p} for i, p in TICK_OUTPUTS],
        [{"id": "live-tick", "property": "n_intervals", "value": 3}],
        [{"id": "live-version", "property": "data", "value": shown}],
    )


def test_the_live_page_refreshes_on_a_new_version_and_follows_the_newest_steps() -> None:
    from hvtrace_dashboard.app import create_app

    first = hand_made_data(make_spans(ranks=4, steps=10))
    feed = _feed(first)
    app = create_app(None, feed=feed)
    client = app.server.test_client()
    text = json.dumps(json.loads(client.get("/_dash-layout").data))
    assert "\\u25cf live: step 9" in text and '"live-version"' in text
    assert "steps 7\\u20139" in text  # a live page opens on the latest steps

    # nothing new: only the live line answers
    resp = _tick(client, {"version": 1, "last": 9})
    assert set(resp) == {"live-status", "live-tick"}, set(resp)
    assert resp["live-tick"]["disabled"] is False

    # the files grew: steps up to 19, and an elastic run's epochs with a hostile host name
    epochs = [
        {"gen": 0, "start_step": 0, "stop_step": 12, "size": 4,
         "workers": [{"worker": w, "rank": w, "host": "h", "horovod_host": "<b>x</b>"}
                     for w in range(4)],
         "analysis": {"step_ms": 70.0, "comm_compute_ratio": 0.5, "stragglers": []}},
        {"gen": 1, "start_step": 12, "stop_step": None, "size": 3,
         "workers": [{"worker": w, "rank": w, "host": "h", "horovod_host": "h"}
                     for w in range(3)],
         "analysis": {"error": "no steps recorded"}},
    ]  # fmt: skip
    grown = replace(
        hand_made_data(make_spans(ranks=4, steps=20)),
        findings=["elastic reset at step 12"],
        membership=epochs,
    )
    _publish(feed, grown)
    resp = _tick(client, {"version": 1, "last": 9})
    assert resp["live-version"]["data"] == {"version": 2, "last": 19, "shown_last": 9}
    assert resp["win-start"]["max"] == 19
    notes = json.dumps(resp["header-notes"]["children"])
    assert "2 membership epochs" in notes and "0:0@<b>x</b>" in notes  # text, not markup
    assert "elastic reset at step 12" in json.dumps(resp["findings"]["children"])

    # the timeline showed the last steps (7-9): it moves to the newest; one moved away stays
    def window(start: int) -> dict:
        body = {
            "output": "..win-start.value...focus-step.data..",
            "outputs": [{"id": "win-start", "property": "value"},
                        {"id": "focus-step", "property": "data"}],
            "inputs": [
                {"id": "heatmap", "property": "clickData", "value": None},
                {"id": "win-prev", "property": "n_clicks", "value": 0},
                {"id": "win-next", "property": "n_clicks", "value": 0},
                {"id": "live-version", "property": "data", "value": resp["live-version"]["data"]},
            ],
            "state": [{"id": "win-start", "property": "value", "value": start},
                      {"id": "win-size", "property": "value", "value": 3}],
            "changedPropIds": ["live-version.data"],
        }  # fmt: skip
        r = client.post("/_dash-update-component", json=body)
        assert r.status_code in (200, 204), r.data[:300]
        return json.loads(r.data)["response"] if r.status_code == 200 else {}

    assert window(7)["win-start"]["value"] == 17
    assert "win-start" not in window(2)
    # a page loaded now gets the new data
    text = json.dumps(json.loads(client.get("/_dash-layout").data))
    assert "\\u25cf live: step 19" in text and "membership epochs" in text

    # the job finished: the line says so, and the timer stops
    with feed._lock:
        feed.live, feed.open_streams = False, 0
    _publish(feed, grown)
    resp = _tick(client, {"version": 2, "last": 19})
    assert "finished" in resp["live-status"]["children"] and resp["live-tick"]["disabled"]
