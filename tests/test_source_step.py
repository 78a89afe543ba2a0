"""One command surface (issue 39): generate, eval and export take a run the same way, one
positional SOURCE and `--step N`, and each reads step N's weights: generate's greedy
tokens and eval's loss equal those recomputed (NumPy, float64) from the checkpoint at
that step restored directly (export's step, in transformers: test_finetune_export). A
step the run has not saved names the steps it has; a Hugging Face folder has no steps;
the older `generate --checkpoint RUN` still works, with a one-line note."""

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import namedmesh as nm
from models import transformer, zoo
from models.cli import evaluate, export, generate
from models.training import checkpoint, data

sys.path.insert(0, str(Path(__file__).parent))
from test_train_cli import SMALL  # noqa: E402

LENGTH, PROMPT, NEW = 16, "def f(x):", 6
TEXT = ("import numpy as np\nx = np.arange(10) * 2\n" * 3)[: 4 * LENGTH + 1]  # 4 whole windows


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny zoo LM trained 1 step, and a second checkpoint (step 3) of other weights,
    saved as training saves: step 1's with the final norm negated, so that its logits
    are negated and every greedy token and loss differs from step 1's."""
    from models.cli import train

    out = tmp_path_factory.mktemp("source") / "run"
    flags = [*SMALL, "--steps", "1", "--save-every", "1", "--eval-every", "100",
             "--out", str(out)]  # fmt: skip
    assert train.main(flags) == 0
    first, _, _ = generate.load(out)
    other = {**first, "final_norm": {k: -v for k, v in first["final_norm"].items()}}
    meta = {k: v for k, v in checkpoint.read_meta(out, 1).items()
            if k not in ("step", "params", "opt_leaves", "checksums")}  # fmt: skip
    saver = checkpoint.Checkpointer(out)
    saver.save(3, {"params": other, "opt": (np.zeros(1, np.float32),)}, meta)
    saver.close()
    return out


def direct(run, steps):
    """step -> logits of ids (up to LENGTH) of the run's checkpoint at that step, restored
    by name from orbax, not by the commands' loading (one compiled forward pass: ids are
    zero-padded to LENGTH, the model being causal)."""
    record = json.loads((run / "run.json").read_text())
    _, cfg, _ = generate.load(run)  # the config; the weights below
    model = zoo.get(record["model"])
    fn = jax.jit(lambda p, ids: model.logits(p, {"inputs": ids}, cfg))
    target = transformer.abstract(model.shapes(cfg))

    def of(params):
        def logits(ids) -> np.ndarray:
            padded = np.zeros((1, LENGTH), np.int32)
            padded[0, : len(ids)] = ids
            out = fn(params, nm.tensor(padded, ("batch", "length")))
            z = np.asarray(out.transpose("batch", "length", "vocab").data, np.float64)
            return z[0, : len(ids)]

        return logits

    return {s: of(checkpoint.restore_params(run, target, s)[0]) for s in steps}


def greedy(logits, ids: list[int], new: int) -> list[int]:
    """Greedy continuation, each token from a full forward pass over all before it."""
    ids = list(ids)
    for _ in range(new):
        ids.append(int(np.argmax(logits(ids)[-1])))
    return ids[-new:]


def window_loss(logits, ids: np.ndarray) -> float:
    """Mean next-token cross-entropy over consecutive windows of LENGTH + 1 tokens."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - LENGTH, LENGTH):
        if start + LENGTH + 1 > len(ids):
            break
        w = ids[start : start + LENGTH + 1]
        z = logits(w[:-1])
        logp = z - z.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        total -= logp[np.arange(LENGTH), w[1:]].sum()
        count += LENGTH
    return total / count


@pytest.fixture(scope="module")
def logits(run):
    return direct(run, (1, 3))


@pytest.fixture(scope="module")
def oracle(run, logits):
    """step -> (greedy tokens of PROMPT, loss on TEXT) of the checkpoint itself."""
    tok = data.load_tokenizer(run)
    out = {s: (greedy(f, tok.encode(PROMPT).tolist(), NEW), window_loss(f, tok.encode(TEXT)))
           for s, f in logits.items()}  # fmt: skip
    assert out[1][0] != out[3][0] and abs(out[1][1] - out[3][1]) > 1e-3  # the steps differ
    return out


@pytest.mark.parametrize("step, source", [(1, []), (3, ["--checkpoint"])])
def test_generate_and_eval_read_the_step_they_are_given(run, oracle, step, source, tmp_path,
                                                        capsys):  # fmt: skip
    """Step 3 by the older spelling, `--checkpoint RUN`: the same, and a one-line note."""
    flags = ["--prompt", PROMPT, "--max-new", str(NEW), "--eos", "none", "--jsonl"]
    assert generate.main([*source, str(run), "--step", str(step), *flags]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["tokens"] == oracle[step][0]
    if source:
        assert out.err.count("\n") == 1 and "--checkpoint is deprecated" in out.err, out.err
        assert f"generate {run} ..." in out.err
    else:
        assert out.err == ""
    (tmp_path / "val.txt").write_text(TEXT)
    got = evaluate.evaluate(evaluate.arguments(
        [str(run), "--step", str(step), "--data", str(tmp_path / "val.txt"), "--batch", "2",
         "--length", str(LENGTH), "--quiet"]))  # fmt: skip
    assert got["tokens"] == 4 * LENGTH
    np.testing.assert_allclose(got["loss"], oracle[step][1], rtol=1e-5)


def one_line_error(main, argv, capsys) -> str:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("command", ["generate", "eval", "export"])
def test_a_step_the_run_has_not_saved_names_the_steps_it_has(run, command, tmp_path, capsys):
    (tmp_path / "val.txt").write_text(TEXT)
    main, extra = {
        "generate": (generate.main, ["--max-new", "1"]),
        "eval": (evaluate.main, ["--data", str(tmp_path / "val.txt")]),
        "export": (export.main, ["--out", str(tmp_path / "hf")]),
    }[command]
    err = one_line_error(main, [str(run), "--step", "7", *extra], capsys)
    assert f"--step 7: {run} has checkpoints at steps [1, 3]" in err, err
    assert not (tmp_path / "hf").exists()


def test_a_hugging_face_folder_has_no_steps(hf, tmp_path, capsys):
    (tmp_path / "val.txt").write_text(TEXT)
    hf, val = str(hf), str(tmp_path / "val.txt")
    for main, argv in [(generate.main, [hf, "--step", "2", "--max-new", "1"]),
                       (evaluate.main, [hf, "--step", "2", "--data", val])]:  # fmt: skip
        err = one_line_error(main, argv, capsys)
        assert f"--step 2: {hf} is a Hugging Face folder, which has no steps" in err, err
    err = one_line_error(export.main, [hf, "--step", "2", "--out", str(tmp_path / "o")], capsys)
    assert f"{hf} is a Hugging Face folder already; export reads a run" in err, err


@pytest.mark.parametrize(
    "argv, says",
    [
        ([], "SOURCE is missing"),
        (["a", "--checkpoint", "b"], "SOURCE a and --checkpoint b name two models: give one"),
    ],
)
def test_generate_without_one_source_is_one_line(argv, says, capsys):
    assert says in one_line_error(generate.main, argv, capsys)


# --- train --init-from SOURCE --step N ---------------------------------------------------

SHORT = 8  # a fine-tune's --length: shorter than the run's learned table of LENGTH rows


@pytest.fixture(scope="module")
def tune(run, tmp_path_factory):
    """source -> flags -> the --out of a 1-step fine-tune of `source` on one repeated byte
    (every window the same, so its first loss is one window's), with an lr so small that
    its checkpoint holds the weights it started from; each fine-tune made once."""
    from models.cli import train

    where = tmp_path_factory.mktemp("tune")
    (where / "a.txt").write_text("a" * 400)
    made = {}

    def fine_tune(source, *flags) -> Path:
        if (source, flags) not in made:
            out = where / f"ft{len(made)}"
            argv = [*SMALL, "--length", str(SHORT), "--batch", "2", "--dropout", "0",
                    "--steps", "1", "--lr", "1e-30", "--data", str(where / "a.txt"),
                    "--init-from", str(source), *flags, "--out", str(out)]  # fmt: skip
            assert train.main(argv) == 0
            made[source, flags] = out
        return made[source, flags]

    return fine_tune


def first_loss(out: Path) -> float:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]


def same_byte_loss(logits, byte: int = ord("a")) -> float:
    """NumPy's loss of a window of SHORT + 1 copies of `byte`."""
    z = logits([byte] * SHORT)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return float(-logp[:, byte].mean())


def restored(run, step) -> dict:
    """The run's parameters at `step`, as orbax restores them by name."""
    _, cfg, _ = generate.load(run)
    target = transformer.abstract(zoo.get("lm").shapes(cfg))
    return checkpoint.restore_params(run, target, step)[0]


def assert_same_params(a: dict, b: dict) -> None:
    pairs = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    for x, y in pairs:
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-12)


def test_a_fine_tune_of_a_run_starts_from_the_step_it_is_given(run, logits, tune):
    """Step 1, not the latest (3); a fine-tune of that fine-tune (no --step: its latest,
    1) starts from the same weights: its OUT/base holds the first run's record."""
    out = tune(run, "--step", "1")
    again = tune(out)
    for ft, source in [(out, run), (again, out)]:
        np.testing.assert_allclose(first_loss(ft), same_byte_loss(logits[1]), rtol=1e-5)
        record = json.loads((ft / "run.json").read_text())
        assert (record["init_from"], record["step"]) == (str(source.absolute()), 1)
        assert_same_params(generate.load(ft)[0], restored(run, 1))


def byte_level(folder: Path) -> Path:
    """`folder` with a tokenizer.json (tokenizers' byte-level BPE, no merges) whose id of
    each byte is the byte, as the byte tokenizer's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's bytes_to_unicode
    shown = dict(zip(chars, chars, strict=True))
    shown |= {b: 256 + i for i, b in enumerate(b for b in range(256) if b not in shown)}
    tok = Tokenizer(models.BPE({chr(c): b for b, c in shown.items()}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def hf(run, tmp_path_factory):
    """The run's latest step (3) exported as a Hugging Face folder (GPT-2's), with a
    byte-level tokenizer."""
    return byte_level(export.export(run, tmp_path_factory.mktemp("hf") / "hf"))


def test_a_fine_tune_of_a_fine_tune_of_a_folder_starts_from_its_step(logits, tune, hf):
    out = tune(tune(hf), "--step", "1")
    np.testing.assert_allclose(first_loss(out), same_byte_loss(logits[3]), rtol=1e-5)
    record = json.loads((out / "run.json").read_text())
    assert (record["family"], record["step"]) == ("gpt2", 1)
    assert (out / "base" / "config.json").exists()  # the folder's files, for eval, export


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--step", "2"], "--step 2: picks the checkpoint of the run --init-from RUN starts"),
        (
            ["--init-from", "{hf}", "--step", "2"],
            "--step 2: {hf} is a Hugging Face folder, which has no steps",
        ),  # fmt: skip
        (
            ["--init-from", "{run}", "--step", "7"],
            "--step 7: {run} has checkpoints at steps [1, 3]",
        ),  # fmt: skip
        (["--init-from", "{run}", "--set", "d_model=64"], "d_model is the architecture of"),
        (
            ["--init-from", "{run}", "--length", "32"],
            "--length 32 is longer than the 16 positions",
        ),  # fmt: skip
        (
            ["--init-from", "{run}", "--set", "length=32"],
            "--set length=32 is longer than the 16 positions",
        ),  # fmt: skip
        (
            ["--out", "{tuned}", "--resume", "--step", "3"],
            "--step 3: --resume continues the run in {tuned} from its own newest",
        ),
    ],
)
def test_train_refuses_a_step_it_cannot_start_from(run, hf, tune, flags, says, tmp_path, capsys):
    from models.cli import train

    tuned = tune(run, "--step", "1") if "{tuned}" in flags else None
    names = {"run": run, "hf": hf, "tuned": tuned}
    flags = [f.format(**names) for f in flags]
    if "--out" not in flags:
        flags += ["--out", str(tmp_path / "out")]
    unset = [f for f in SMALL if f not in ("--length", "16")]  # the run's length is its own
    assert says.format(**names) in one_line_error(train.main, [*unset, *flags], capsys)
    assert not (tmp_path / "out").exists()
