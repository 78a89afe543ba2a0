"""Training's edge cases outside the issues (fuzzed): each test a mistake or corner a
user meets, checked against an oracle apart from the code under test (the run's own
record, a NumPy computation, an uninterrupted run)."""

import contextlib
import io
import json
import os
import shutil
import signal

import optax
import pytest

from lowering import Mesh
from models import catalog, zoo
from models.cli import launch, train
from models.layers import lora
from models.training import chat, checkpoint, corpora, data, run, trainable
from models.training.trainer import Trainer, TrainSpec
from namedmesh.errors import ParameterError
from tests.test_models import CFG, small_batch
from tests.test_resume_record import run as main  # the command in process: (status, out, err)


def test_a_resume_holds_a_config_files_flags_to_the_record_as_the_command_lines(tmp_path, capsys):
    """`--resume --config-file F`: F's --steps (changeable) is applied and said, F's
    --seed (not changeable) refused naming both values, never both left silently at the
    record's (run.json holds the run's seed 0 and 3 steps)."""
    out = tmp_path / "run"
    out.mkdir()
    first = train.arguments(["--steps", "3", "--out", str(out)])
    (out / "run.json").write_text(json.dumps(run.record_of(first)))
    before = (out / "run.json").read_text()
    (tmp_path / "more.json").write_text(json.dumps({"steps": 6, "seed": 5}))
    code, said, err = main("--out", out, "--resume", "--config-file", tmp_path / "more.json",
                           capsys=capsys)  # fmt: skip
    assert "--steps 6 (of --config-file" in said and "recorded 3; going on with 6" in said
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "--seed 5 (of --config-file" in lines[0] and "which recorded 0" in lines[0]
    assert (out / "run.json").read_text() == before


SMALL = ["--config", "tiny", "--length", "16", "--batch", "8", "--quiet", "--eval-batches", "1"]


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    """(folder, stdout, metrics) of a run of 4 steps at lr 1e30 after a warmup of 8,
    saving at 2 and 4, skipping up to 3 non-finite steps: update 1 (lr 1.25e29) is
    finite but huge, so steps 3 and 4 are not finite and skipped. A SIGTERM comes as
    the last save is being finished (Checkpointer.close); os._exit raises instead of
    ending pytest, should the signal end the run."""
    out = tmp_path_factory.mktemp("short") / "run"
    flags = [*SMALL, "--steps", "4", "--save-every", "2", "--warmup", "8", "--lr", "1e30",
             "--skip-nonfinite", "3"]  # fmt: skip
    close = checkpoint.Checkpointer.close

    def signalled(self):
        os.kill(os.getpid(), signal.SIGTERM)
        close(self)

    def exit_now(code):
        raise SystemExit(code)

    said = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(said):
        patch.setattr(checkpoint.Checkpointer, "close", signalled)
        patch.setattr(os, "_exit", exit_now)
        assert train.main([*flags, "--out", str(out)]) == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped", False) for r in records] == [False, False, True, True]
    return out, said.getvalue(), records


def test_the_lr_logged_is_the_one_a_step_computed_with_after_skipped_steps(short):
    """Update i of a warmup of 8 is lr i / 8. A skipped step leaves the optimizer's
    update count where it was, so steps 3 and 4 both compute with update 2's lr (step 4
    logged update 3's)."""
    lrs = [r["lr"] for r in short[2]]
    assert lrs == pytest.approx([0.0, 1e30 / 8, 2e30 / 8, 2e30 / 8], rel=1e-6)


def test_a_sigterm_while_the_last_save_ends_waits_for_it(short):
    """The run trained every step: the signal (which ended the process at once, the
    step-4 save half written) lets the save end, the run exits 0 with both checkpoints."""
    assert checkpoint.all_steps(short[0]) == [4, 2]


def test_a_warmup_longer_than_the_run_is_said_with_the_peak_it_reaches(short):
    """The 4 steps' schedule rises to update 3's lr, 3e30 / 8, never to 1e30."""
    lines = [x for x in short[1].splitlines() if "--warmup 8" in x]
    assert lines == [
        "--warmup 8 is not shorter than --steps 4: the learning rate rises from 0 to "
        "3.75e+29 at the last step, never to --lr 1e+30 nor its cosine decay; pass --warmup "
        "under 4 to reach it"
    ]


def test_a_resume_to_fewer_steps_than_the_run_took_is_refused_touching_nothing(
    short, tmp_path, capsys
):
    """The run is at step 4: `--resume --steps 3` cannot go on (nor back), and its
    record and log stay as they were (it said "going on with 3", exit 0, and recorded 3)."""
    out = tmp_path / "run"
    shutil.copytree(short[0], out)
    before = {f: (out / f).read_text() for f in ("run.json", "metrics.jsonl")}
    code, _, err = main("--out", out, "--resume", "--quiet", "--steps", "3", capsys=capsys)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, err
    assert f"--steps 3: the run in {out} is at step 4 already" in lines[0]
    assert {f: (out / f).read_text() for f in before} == before


def test_a_lora_target_the_model_lacks_names_those_it_has():
    """The tiny LM's FFN is plain (wi, wo: no wg), its attention q, k, v, o: --lora-targets
    gate names what it can adapt, not "none" (only the targets asked were listed)."""
    model = zoo.get("lm")
    cfg = model.configure(catalog.get("tiny"))
    names = {p.rsplit("/", 1)[-1] for p in trainable.paths(model.shapes(cfg))}
    assert {"q", "k", "v", "o", "wi", "wo"} <= names and "wg" not in names
    with pytest.raises(lora.LoraError) as e:
        lora.adapted(model, lora.Lora(4, targets=("gate",)), cfg)
    assert "no gate projection" in str(e.value) and "it adapts q, k, v, o, up, down;" in str(
        e.value
    )


def test_a_validation_split_left_without_assistant_tokens_is_named(tmp_path):
    """Line 2 (the last tenth: the validation split) is cut to 17 bytes inside its user
    turn: the error names that split, not the file whose line 1 keeps its answer."""

    def turn(user, answer):
        return {"messages": [{"role": "user", "content": user},
                             {"role": "assistant", "content": answer}]}  # fmt: skip

    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(turn("hi", "ok")) + "\n" + json.dumps(turn("a" * 40, "b")) + "\n")
    with pytest.raises(data.DataError) as e:
        corpora.make(corpora.load(str(path)), data.ByteTokenizer(), 16)
    assert str(e.value).startswith(f"the validation split of --data {path} (its last tenth): ")


@pytest.mark.parametrize(
    "field, change, says",
    [
        ("targets", lambda v: v + 32, "the batch's targets hold the id"),  # 32 + max <= 63
        ("inputs", lambda v: v - 32, "the batch's inputs hold the id -"),
        ("weights", None, "the batch has no weights: the lm objective's batch holds inputs, "
                          "targets, weights"),
        ("weights", lambda v: v[:, :4], "the batch's weights has the shape (4, 4); every "
                                        "field of a batch is (batch, length), as inputs' (4, 8)"),
    ],
)  # fmt: skip
def test_a_python_api_batch_out_of_the_vocabulary_or_short_of_a_field_is_a_data_error(
    field, change, says
):
    """Trainer's batches (the Python API's; the command line's are its tokenizer's):
    the embedding's gather would clamp an id >= vocab (32) and a negative one, silently."""
    tr = Trainer(zoo.get("lm"), CFG, Mesh({"one": 1}), "", TrainSpec(optax.sgd(0.1)))
    batch = small_batch(CFG)
    if change is None:
        del batch[field]
    else:
        batch[field] = change(batch[field])
    with pytest.raises(data.DataError) as e:
        tr.place_batch(batch)
    assert says in str(e.value) and ("vocabulary 0 ... 31" in str(e.value)) == ("id" in says)


def test_a_batch_that_grad_accum_does_not_divide_is_a_data_error():
    """3 rows in microbatches of equal rows for grad_accum 2 (a reshape's TypeError)."""
    tr = Trainer(zoo.get("lm"), CFG, Mesh({"one": 1}), "", TrainSpec(optax.sgd(0.1), 0, 2))
    with pytest.raises(data.DataError, match="the batch's 3 rows: grad_accum 2"):
        tr.update(None, small_batch(CFG.replace(batch=3)), 1)  # (checked before the state)


def test_an_evaluation_only_trainer_holds_parameters_and_refuses_to_update():
    """TrainSpec() has no optimizer: init_state places the parameters (no optimizer
    state), update is a ParameterError saying so (it was an AttributeError of None)."""
    tr = Trainer(zoo.get("lm"), CFG, Mesh({"one": 1}), "", TrainSpec())
    state = tr.init_state()
    assert state["opt"] is None and set(state["params"]) == set(tr.shapes)
    with pytest.raises(ParameterError, match="has no optimizer"):
        tr.update(state, small_batch(CFG), 1)


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--min-lr", "0.01"], "--min-lr 0.01: above --lr 0.003, the peak: the cosine schedule "
                               "would raise the learning rate"),
        (["--init-from", "x", "--schedule", "wsd", "--min-lr", "1e-4"],
         "--min-lr 0.0001: above --lr 5e-05, the peak: the wsd schedule"),
        (["--schedule", "constant", "--min-lr", "0"], "--min-lr 0.0: the constant schedule "
                                                      "stays at --lr 0.003, it has no end lr"),
    ],
)  # fmt: skip
def test_a_min_lr_the_schedule_cannot_take_is_refused_by_the_flags(flags, says, capsys):
    """The peaks are the defaults (3e-3 from scratch, 5e-5 for a fine-tune: docs/finetune.md);
    a cosine from 0.003 "down" to 0.01 rose, a constant schedule ignored its --min-lr."""
    with pytest.raises(SystemExit) as e:
        train.arguments(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_a_folders_files_are_joined_as_documents_never_glued(tmp_path):
    """Two JSON lines files (their documents joined by newlines within each) and a text
    file without a last newline: the folder's text is every document on its own line
    (the last file's "b.jsonl"'s first document was glued to "a.jsonl"'s last)."""
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "three"}\n')
    (tmp_path / "c.txt").write_text("four\n")
    (tmp_path / "d.txt").write_text("five")
    assert data.load_text(str(tmp_path)) == "one\ntwo\nthree\nfour\nfive"


@pytest.mark.parametrize("grace", ["inf", "nan", "-1"])
def test_launch_refuses_a_grace_that_is_not_a_finite_time(grace, capsys):
    """--grace inf would leave a hung process's peers waiting on it forever."""
    with pytest.raises(SystemExit) as e:
        launch.arguments(["-n", "2", "--grace", grace, "--", "train"], "namedmesh launch")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "must be a finite number >= 0" in err, err


def test_conversations_whose_answers_render_no_token_are_said_and_left_out(tmp_path, capsys):
    """A template that writes nothing after an assistant's content (no end-of-turn
    text) and an empty answer: the example has no token to learn and is left out, said
    in one line naming its line (it was left out silently when nothing was cut)."""
    source = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% endfor %}"
              "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")  # fmt: skip
    t = chat.Template(source, "the test's template")
    rows = [("hi", "hello"), ("q", ""), ("a", "b"), ("c", "d")]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": u},
                    {"role": "assistant", "content": a}]}) + "\n" for u, a in rows))  # fmt: skip
    corpus = chat.ChatCorpus(corpora.load(str(path)), data.ByteTokenizer(), 64, "lm", None, t)
    said = capsys.readouterr().out
    assert f"{path}: 1 conversation(s) whose assistant messages render no token" in said
    assert "(lines 2)" in said
    # rows: line 1 and line 3 packed into the training row (line 4 is validation)
    assert corpus.train["segments"].max() == 2
