"""The benchmarks against PyTorch at tiny sizes: both sides compute the same thing (the
zoo's first training loss is PyTorch's, greedy decoding gives generate's tokens), every
side is timed in every round, and the sides alternate their order round by round."""

import pytest

from benchmarks import decode, fair, peak, zoo_families, zoo_vs_hf

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _threads_kept(monkeypatch):
    """The benchmarks make this process single-threaded; the test session stays as it is."""
    monkeypatch.setattr(fair, "single_threaded", lambda: "threads as the tests run")


def test_alternate_reverses_the_order_every_other_round():
    calls = []
    sides = {name: (lambda n=name: calls.append(n)) for name in "abc"}
    times = fair.alternate(sides, rounds=3)
    assert calls == list("abc") + list("abc") + list("cba") + list("abc")  # warm-up first
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert fair.ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0]) == "2.00 / 2.00"


def test_zoo_vs_hf_trains_the_same_model_and_times_every_side():
    got = zoo_vs_hf.main("--layers 1 --d-model 16 --heads 2 --vocab 48 --length 8 --batch 2 "
                         "--repeats 2 --no-compile".split())  # fmt: skip
    zoo, torch = got["losses"]
    assert zoo == pytest.approx(torch, abs=1e-4)
    for times in (got["forward"], got["step"]):
        assert set(times) == {"namedmesh", "PyTorch eager"}
        assert all(len(t) == 2 and min(t) > 0 for t in times.values())


def test_zoo_vs_hf_families_checks_logits_and_loss_then_times_each_family(monkeypatch, capsys):
    """Two families (a decoder with a window, an encoder-decoder) at the tiniest size:
    the same logits and first training loss as transformers, both passes timed; the
    step's table gives namedmesh's compile seconds, the matmul flops and each side's
    fraction of the peak (T5's flops not counted, said so)."""
    monkeypatch.setattr(peak, "matmul_peak", lambda: {"PyTorch": 2.0, "XLA": 1.0, "peak": 2.0})
    got = zoo_vs_hf.main("--families mistral,t5 --layers 1 --d-model 16 --heads 2 --vocab 48 "
                         "--length 8 --batch 2 --repeats 2 --no-compile".split())  # fmt: skip
    assert list(got) == ["mistral", "t5"]
    for r in got.values():
        assert r["error"] < zoo_families.TOLERANCE
        zoo, torch = r["losses"]
        assert zoo == pytest.approx(torch, abs=1e-4)
        assert r["compile"]["namedmesh"] > 0 and r["compile_cpu"] > 0
        for what in ("forward", "step"):
            assert set(r[what]) == {"namedmesh", "PyTorch eager"}
            assert all(len(t) == 2 and min(t) > 0 for t in r[what].values())
    # Mistral's shape by hand: 1 layer, d_model 16, 2 heads of 8, 1 kv head, d_ff 32, gated
    flops = peak.step_flops(peak.Shape(1, 16, 2, 1, 8, 32, 3, 48), 2, 8)
    assert got["mistral"]["flops"] == flops and got["t5"]["flops"] is None
    out = capsys.readouterr().out.split("Training step (forward, backward, AdamW):")
    first = out[1].split("\n\n")[1]  # Mistral's rows, printed before T5 ran
    assert "| mistral |" in first and "| t5 |" not in first
    lines = out[-1]  # the last step table: all families
    head, _, *rows = [ln.strip("| ").split(" | ") for ln in lines.split("\n\n")[1].splitlines()]
    cells = {row[0]: dict(zip(head, row, strict=True)) for row in rows}
    for side in ("namedmesh", "PyTorch eager"):
        pct = 100 * flops / min(got["mistral"]["step"][side]) / 2e9
        assert cells["mistral"][f"{side} % of peak"] == f"{pct:.0f}%"
        assert cells["t5"][f"{side} % of peak"] == "—"
    assert cells["mistral"]["matmul GFLOP"] == f"{flops / 1e9:.1f}"
    assert cells["t5"]["matmul GFLOP"].startswith("— (t5: an encoder-decoder")
    assert cells["t5"]["namedmesh compile s"].startswith(f"{got['t5']['compile']['namedmesh']:.1f}")
    assert cells["mistral"]["transformers' experts"] == "—"  # dense


def test_zoo_vs_hf_size_sets_issue_40s_sizes():
    p = zoo_vs_hf.parser()
    args = p.parse_args(["--size", "realistic"])
    zoo_vs_hf.sized(p, args)
    sizes = (args.layers, args.d_model, args.heads, args.vocab, args.length, args.batch)
    assert sizes == (4, 512, 8, 8192, 512, 4)  # issue 40's realistic size


def test_zoo_vs_hf_families_has_a_config_for_every_family():
    from models.io import hub

    assert set(zoo_families.configs(1, 16, 2, 48, 8)) == set(hub.FAMILIES)


def test_zoo_vs_hf_families_refuses_an_unknown_family(capsys):
    with pytest.raises(SystemExit) as e:
        zoo_vs_hf.main("--families mistral,llama4 --repeats 1".split())
    assert e.value.code == 2
    assert "--families: unknown ['llama4']; known: bert, deepseek_v3" in capsys.readouterr().err


def test_decode_gives_generates_greedy_tokens_at_every_batch():
    flags = "--positions 32 --layers 1 --d-model 16 --heads 4 --kv-heads 2 --d-ff 24 --vocab 48"
    got = decode.main(f"{flags} --prompt 5 --new 6 --batches 1,3 --rounds 1 --no-compile".split())
    assert set(got) == {1, 3}
    for r in got.values():
        assert r["agree"] == 1.0
        assert set(r["times"]) == {"namedmesh", "generate"} and min(r["times"]["generate"]) > 0


def test_decode_families_gives_generates_tokens_for_prompts_of_different_lengths():
    """A family's rows of different lengths (right-padded here, left-padded for generate)
    decode to generate's tokens."""
    flags = "--positions 32 --layers 1 --d-model 16 --heads 4 --vocab 48 --prompt 8 --new 5"
    got = decode.main(f"--families opt {flags} --batches 3 --rounds 1 --no-compile".split())
    assert list(got) == ["opt, batch 3, ragged"]
    r = got["opt, batch 3, ragged"]
    assert r["agree"] == 1.0 and set(r["times"]) == {"namedmesh", "generate"}
