"""Prices, the SQLite ledger, cached-token billing end to end, and `ember cost`."""

from __future__ import annotations

import json
import uuid

import openai
import pytest

from ember.cli import main
from ember.server.billing import Ledger, LedgerEntry, Prices, PriceTable

MODEL = "tiny-llama"


def entry(request_id: str, **fields) -> LedgerEntry:
    base = dict(model="m", endpoint="completions", lane="interactive", status="ok",
                prompt_tokens=1000, cached_tokens=0, completion_tokens=100, cost_usd=0.0,
                saved_usd=0.0)
    return LedgerEntry(request_id=request_id, **{**base, **fields})


def test_cost_charges_cached_tokens_at_the_cached_rate() -> None:
    prices = Prices()  # Kimi K2.5: 0.60 / 0.10 / 3.00 USD per million
    billed, saved = prices.cost(prompt_tokens=1_000_000, cached_tokens=0,
                                completion_tokens=1_000_000)
    assert (billed, saved) == pytest.approx((3.60, 0.0))
    billed, saved = prices.cost(prompt_tokens=1_000_000, cached_tokens=600_000,
                                completion_tokens=0)
    assert billed == pytest.approx(0.4 * 0.60 + 0.6 * 0.10)
    assert saved == pytest.approx(0.6 * (0.60 - 0.10))


def test_price_file(tmp_path) -> None:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"default": {"input": 1, "cached_input": 0.5, "output": 2},
                                "big": {"input": 10, "cached_input": 1, "output": 20}}))
    table = PriceTable.from_file(path)
    assert table.for_model("big") == Prices(10, 1, 20)
    assert table.for_model("other") == Prices(1, 0.5, 2)
    assert PriceTable.from_file(None).for_model("x") == Prices(0.60, 0.10, 3.00)
    path.write_text(json.dumps({"big": {"input": -1, "cached_input": 1, "output": 1}}))
    with pytest.raises(ValueError, match="prices.input"):
        PriceTable.from_file(path)
    path.write_text(json.dumps({"big": {"inputs": 1}}))
    with pytest.raises(ValueError, match="price_file"):
        PriceTable.from_file(path)


def test_ledger_groups_and_time_range(tmp_path) -> None:
    ledger = Ledger(tmp_path / "l.sqlite")
    ledger.record(entry("a", key_id="k1", session_id="s1", cost_usd=1.0, ts=100.0))
    ledger.record(entry("b", key_id="k1", session_id="s2", cost_usd=2.0, saved_usd=0.5,
                        cached_tokens=500, ts=200.0))
    ledger.record(entry("c", key_id="k2", session_id="s2", cost_usd=4.0, ts=300.0))
    by_key = {r.group: r for r in ledger.spend("key")}
    assert by_key["k1"].requests == 2 and by_key["k1"].cost_usd == pytest.approx(3.0)
    assert by_key["k1"].saved_usd == pytest.approx(0.5) and by_key["k1"].cached_tokens == 500
    by_session = ledger.spend("session", since=150.0, until=300.0)
    assert [(r.group, r.requests) for r in by_session] == [("s2", 1)]
    (total,) = ledger.spend(None)
    assert total.requests == 3 and total.cost_usd == pytest.approx(7.0)
    with pytest.raises(ValueError, match="by"):
        ledger.spend("colour")
    ledger.close()


def test_shared_prefix_is_cached_and_billed_less(tiny_server, capsys) -> None:
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    session = f"billing-{uuid.uuid4().hex[:8]}"
    prefix = f"{uuid.uuid4().hex} " + " ".join(f"item{i}" for i in range(70))

    def ask(suffix: str, **extra):
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=f"{prefix} {suffix}", max_tokens=4,
            extra_body={"ignore_eos": True, **extra},
            extra_headers={"x-session-affinity": session})
        assert raw.headers["x-session-affinity"] == session
        return raw.parse()

    first = ask("alpha")
    second = ask("omega")
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 150
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 128 and cached % 16 == 0  # whole 16-token blocks of the shared prefix

    ledger = Ledger(tiny_server.ledger_path)
    rows = {e.request_id: e for e in ledger.entries() if e.session_id == session}
    ledger.close()
    a, b = rows[first.id], rows[second.id]
    assert (a.lane, b.lane) == ("interactive", "interactive")
    assert (a.cached_tokens, b.cached_tokens) == (0, cached)
    assert b.completion_tokens == a.completion_tokens == 4
    assert b.cost_usd < a.cost_usd
    assert a.cost_usd - b.cost_usd == pytest.approx(b.saved_usd)
    assert b.saved_usd == pytest.approx(cached * (0.60 - 0.10) / 1e6)

    assert main(["cost", "--ledger", str(tiny_server.ledger_path), "--by", "session"]) == 0
    table = capsys.readouterr().out
    (line,) = [row for row in table.splitlines() if row.startswith(session)]
    assert line.split()[1:4] == ["2", str(2 * first.usage.prompt_tokens), str(cached)]
    assert float(line.split()[-1]) == pytest.approx(b.saved_usd, abs=1e-6)
    assert main(["cost", "--ledger", str(tiny_server.ledger_path), "--by", "lane", "--since",
                 "1h", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "interactive" in {r["group"] for r in report["rows"]}
    assert report["saved_usd"] >= b.saved_usd
    assert main(["cost", "--ledger", str(tiny_server.ledger_path), "--since",
                 "2000-01-01", "--until", "2000-01-02"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split()[1] == "0"  # TOTAL: no requests
