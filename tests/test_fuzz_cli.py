"""The command lines' promise under bad input, fuzzed: every flag of every subcommand
(read from its argparse parser, so a flag added later is fuzzed too) given malformed
values, and malformed files of each kind a command reads, end in one line on stderr
and exit status 2: never a traceback, never silence. Commands run in process through
their `main(argv)`; `jax.jit` is replaced by a sentinel so that an input that passes
every check stops where compiling would start (such an input was accepted: only
values that are certainly malformed must be refused)."""

import json
import sys

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import namedmesh as nm
from models.cli import evaluate, export, generate, train  # noqa: F401
from models.cli.train import Parser
from models.io import hub  # noqa: F401
from models.layers.common import Param
from models.training import run  # noqa: F401

TEXT = "The assert statement checks a condition at run time. " * 40


class Compiling(BaseException):
    """jax.jit reached: the input passed every check made before the programs are built
    (a layout's rules are checked against the traced model after that)."""


JIT = jax.jit


def compiling(*args, **kwargs):
    if sys._getframe(1).f_code.co_name == "<module>":  # a decorator of a module imported
        return JIT(*args, **kwargs)  # lazily (optax's, orbax's): not compiling yet
    raise Compiling


class Built(Exception):
    pass


def parser_of(module) -> Parser:
    """The parser `module.arguments` builds (train, generate, eval and export each
    build theirs there), caught at its parse_args."""
    got = {}

    def grab(self, *args, **kwargs):
        got["parser"] = self
        raise Built

    original = Parser.parse_args
    Parser.parse_args = grab
    try:
        module.arguments([])
    except (Built, SystemExit):
        pass
    finally:
        Parser.parse_args = original
    return got["parser"]


def outcome(main, argv, capsys) -> str:
    """ "refused" (exit 2, one line naming the fault), "compiles" (accepted), or what
    broke the promise."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    except Compiling:
        capsys.readouterr()
        return "compiles"
    except Exception as e:
        return f"raised {type(e).__name__}: {e}"
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("warning:")]
    if code == 2 and len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err:
        return "refused"
    return f"exit {code} with stderr {err[-300:]!r}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny GPT-2 Hugging Face folder with a byte-level BPE tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    hf = {"model_type": "gpt2", "n_embd": 16, "n_head": 2, "n_layer": 1, "vocab_size": 300}
    hf |= {"n_positions": 16}
    cfg = hub.family_config("gpt2", hf, set())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(sorted(pre_tokenizers.ByteLevel.alphabet()))
    rng = np.random.default_rng(0)  # NumPy values: nothing compiled for them
    params = jax.tree_util.tree_map(
        lambda p: nm.tensor(rng.normal(size=tuple(p.sizes.values())).astype(np.float32), p.sizes),
        hub.shapes_of("gpt2", cfg),
        is_leaf=lambda x: isinstance(x, Param),
    )
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    hub.save(hub.HubModel("gpt2", cfg, params, tok, hf), path)
    return path


@pytest.fixture
def no_compiling(monkeypatch):
    monkeypatch.setattr(jax, "jit", compiling)


# --- every flag ----------------------------------------------------------------------
NUMBERS = ["1" + "0" * 30, "-1" + "0" * 30, "-1", "nan", "-inf", "1e400", "abc", "", "1,5"]
MESHES = ["dätä=1", "a=0", "a=99999999999", "", "a", "=2", "a=1,a=1", "a=²", "1a=1"]
SETS = ["vocab=9", "nofield=1", "heads=0", "d_model=" + "9" * 30, "=", "dropout=nan"]
SETS += ["dtype=ü", "rope={'theta': [", "layers=-1"]
TEXTS = ["", "ü∂ß", "/nonexistent/nowhere", "-", "a" * 5000]


def malformed(action) -> tuple[list[str], bool]:
    """(values to give the flag, whether every one of them must be refused)."""
    if action.type is int:
        return NUMBERS, True
    if action.type is float:  # a huge float may be a value (a clip that never clips)
        return [v for v in NUMBERS if v != NUMBERS[0]], True
    if action.type is train.parse_mesh:
        return MESHES, True
    if action.choices:
        return ["nope", "", "ü"], True
    if action.dest == "set":
        return SETS, True
    if action.dest == "eos":  # ids outside the vocabulary (300 ids) would never end a row
        return ["1" + "0" * 30, "-1", "300"], True
    return TEXTS, False  # a path or text: some of these may be fine


def test_every_flag_of_every_command_is_refused_in_one_line(tmp_path, folder, no_compiling, capsys):
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    bases = {  # a command line that is fine: each case changes one flag of it
        train: ["--config", "tiny", "--length", "8", "--batch", "2", "--steps", "2"]
        + ["--quiet", "--data", str(data), "--out", str(tmp_path / "run")],
        generate: [str(folder), "--max-new", "2", "--prompt", "ab"],
        evaluate: [str(folder), "--data", str(data), "--length", "8", "--batch", "2", "--quiet"],
        export: [str(tmp_path / "no-run"), "--out", str(tmp_path / "exported")],
    }
    for module, base in bases.items():  # the bases pass every check (export: no run)
        want = "refused" if module is export else "compiles"
        assert outcome(module.main, base, capsys) == want, module
    broken = []
    for module, base in bases.items():
        actions = [a for a in parser_of(module)._actions if a.option_strings and a.nargs != 0]
        assert len(actions) >= 2, module  # the parser was found
        for action in actions:
            flag = action.option_strings[-1]
            values, refuse = malformed(action)
            for value in values:
                got = outcome(module.main, [*base, flag, value], capsys)
                if got not in (("refused",) if refuse else ("refused", "compiles")):
                    broken.append(f"{module.__name__} {flag} {value[:40]!r}: {got}")
        positional = [a for a in parser_of(module)._actions if not a.option_strings]
        for action in positional:  # replace it: the first item of the base
            for value in TEXTS:
                got = outcome(module.main, [value, *base[1:]], capsys)
                if got not in ("refused", "compiles"):
                    broken.append(f"{module.__name__} {action.dest} {value[:40]!r}: {got}")
    assert not broken, "\n".join(broken)


def test_every_numeric_flag_of_every_command_has_a_declared_range():
    """The class, not the cases: generate's and eval's numbers are checked before the
    model is read, as train's are (temperature, top-k, top-p by Sampling as well)."""
    for module in (generate, evaluate):
        numeric = {a.dest for a in parser_of(module)._actions if a.type in (int, float)}
        assert numeric - set(module.RANGES) <= {"top_p", "temperature"}, module


# --- every kind of file ----------------------------------------------------------------
def _npy(path, array):
    np.save(path, array)


def data_files(tmp):
    """name -> a malformed file (or folder) of each kind --data reads."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = {}

    def write(name, content):
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        out[name] = path

    write("binary.txt", bytes(range(256)) * 8)
    write("latin1.txt", "café ".encode("latin-1") * 200)
    write("empty.txt", "")
    write("short.txt", "ab")
    write("nulltext.jsonl", '{"text": null}\n' + '{"text": "abc"}\n' * 300)
    write("numbertext.jsonl", '{"text": 5}\n' * 300)
    write("notobject.jsonl", "[1, 2]\n")
    write("notjson.jsonl", '{"text": "a"\n{"text": "b"}\n')
    write("nofield.jsonl", '{"body": "a"}\n')
    write("binary.jsonl", b"\x00\x01\x02" * 100)
    write("empty.bin", b"")
    write("odd.bin", b"\x01\x00\x02")
    write("beyond.bin", np.full(400, 60000, np.uint16).tobytes())
    write("garbage.parquet", "not parquet at all")
    write("truncated.npy", b"\x93NUMPY\x01\x00v\x00{'descr': '<i4', 'fortran_order': False, 'sh")
    write("folder/b.bin", b"\x00\x01" * 10)  # a folder of text holding a token file
    (tmp / "folder/a.txt").write_text(TEXT)
    out["folder"] = out.pop("folder/b.bin").parent
    for name, array in {
        "negative.npy": np.array([-3, 1, 2] * 200, np.int32),
        "float.npy": np.ones(600, np.float32),
        "matrix.npy": np.ones((30, 20), np.int32),
        "bool.npy": np.ones(600, bool),
        "empty.npy": np.zeros(0, np.int32),
        "beyond.npy": np.array([1, 2, 10**12] * 200, np.int64),
    }.items():
        _npy(tmp / name, array)
        out[name] = tmp / name
    for name, column in {
        "nulltext.parquet": pa.array([None] + [TEXT] * 3, pa.string()),
        "inttext.parquet": pa.array(list(range(600))),
    }.items():
        pq.write_table(pa.table({"text": column}), tmp / name)
        out[name] = tmp / name
    return out


def test_malformed_data_files_of_each_kind_are_one_line_and_exit_2(tmp_path, no_compiling, capsys):
    base = ["--config", "tiny", "--length", "8", "--batch", "2", "--steps", "2", "--quiet"]
    broken = []
    for name, path in data_files(tmp_path / "data").items():
        for flag in ("--data", "--val-data"):
            argv = [*base, "--out", str(tmp_path / "run"), "--data", str(path)]
            if flag == "--val-data":
                good = tmp_path / "good.txt"
                good.write_text(TEXT)
                argv = [*base, "--out", str(tmp_path / "run"), "--data", str(good), flag, str(path)]
            got = outcome(train.main, argv, capsys)
            if got != "refused":
                broken.append(f"{flag} {name}: {got}")
    assert not broken, "\n".join(broken)


def test_malformed_tokenizer_config_and_prompt_files_are_one_line_and_exit_2(
    tmp_path, folder, no_compiling, capsys
):
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    base = ["--config", "tiny", "--length", "8", "--batch", "2", "--steps", "2", "--quiet"]
    base += ["--data", str(data), "--out", str(tmp_path / "run")]
    files = {
        "notjson.json": "{",
        "list.json": "[1, 2]",
        "unknown.json": '{"kind": "nope"}',
        "truncated.json": folder.joinpath("tokenizer.json").read_text()[:200],
        "binary.json": "\x00\x01",
    }
    broken = []
    for name, content in files.items():
        path = tmp_path / name
        path.write_text(content)
        for flag in ("--tokenizer", "--config-file"):
            got = outcome(train.main, [*base, flag, str(path)], capsys)
            if got != "refused":
                broken.append(f"{flag} {name}: {got}")
    settings = {"warmup": "many", "nope": 1, "mesh": "dätä=1", "seed": -1, "set": 5}
    settings |= {"quiet": "yes", "optimizer": "rmsprop", "clip": [1], "length": {"a": 0}}
    for key, value in settings.items():
        path = tmp_path / f"settings-{key}.json"
        path.write_text(json.dumps({key: value}))
        got = outcome(train.main, [*base, "--config-file", str(path)], capsys)
        if got != "refused":
            broken.append(f"--config-file {{{key}: {value!r}}}: {got}")
    prompts = {"binary.txt": bytes(range(256)), "empty.txt": b"\n\n", "latin1.txt": b"caf\xe9"}
    for name, content in prompts.items():
        path = tmp_path / f"prompts-{name}"
        path.write_bytes(content)
        argv = [str(folder), "--prompts", str(path), "--max-new", "2"]
        got = outcome(generate.main, argv, capsys)
        if got != "refused":
            broken.append(f"--prompts {name}: {got}")
    assert not broken, "\n".join(broken)


# --- damaged Hugging Face folders ------------------------------------------------------
FC = "transformer.h.0.mlp.c_fc.weight"


def _weights_as(dtype):
    def damage(path):
        from safetensors.numpy import load_file, save_file

        tensors = load_file(path / "model.safetensors")
        tensors[FC] = tensors[FC].astype(dtype)
        save_file(tensors, path / "model.safetensors", {"format": "pt"})

    return damage


def _json(name, value):
    return lambda path: (path / name).write_text(json.dumps(value))


def _text(name, text):
    return lambda path: (path / name).write_text(text)


def _edit(name, **changes):
    def damage(path):
        (path / name).write_text(json.dumps(json.loads((path / name).read_text()) | changes))

    return damage


def _truncate(name):
    return lambda path: (path / name).write_bytes((path / name).read_bytes()[:300])


# damage -> what the one line names (the file, and the tensor and dtype of a weight)
DAMAGES = {
    "config.json a list": (_json("config.json", [1]), "config.json"),
    "config.json n_embd text": (_edit("config.json", n_embd="16"), "config.json"),
    "tokenizer.json not JSON": (_truncate("tokenizer.json"), "tokenizer.json"),
    "tokenizer.json a list": (_json("tokenizer.json", [1, 2]), "tokenizer.json"),
    "eos_token_id text": (_edit("config.json", eos_token_id="abc"), "config.json: eos_token_id"),
    "eos_token_id bool": (_edit("config.json", eos_token_id=True), "config.json: eos_token_id"),
    "eos_token_id float": (_json("generation_config.json", {"eos_token_id": 1.5}), "generation"),
    "eos_token_id list": (_edit("config.json", eos_token_id=[1, None]), "eos_token_id"),
    "tokenizer_config.json a list": (_json("tokenizer_config.json", []), "tokenizer_config"),
    "eos_token a number": (_json("tokenizer_config.json", {"eos_token": 5}), "eos_token"),
    "chat template fails": (_text("chat_template.jinja", "{{ 1/0 }}"), "chat_template.jinja"),
    "chat template unbounded": (_text("chat_template.jinja", "{{ 'x' * 10**10 }}"), "jinja"),
    "int weights": (_weights_as(np.int32), f"{FC!r} of model.safetensors is I32"),
    "bool weights": (_weights_as(bool), f"{FC!r} of model.safetensors is BOOL"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_hugging_face_folder_is_one_line_naming_the_file(
    damage, folder, tmp_path, no_compiling, capsys
):
    import shutil

    path = tmp_path / "hf"
    shutil.copytree(folder, path)
    write, names = DAMAGES[damage]
    write(path)
    argv = [str(path), "--max-new", "2", "--eos", "none", "--prompt", "ab"]
    if "eos_token_id" in damage or "generation" in names:
        argv.remove("--eos"), argv.remove("none")  # the folder's ids are read without --eos
    if "tokenizer_config" in names or names in ("eos_token", "jinja", "chat_template.jinja"):
        if not (path / "chat_template.jinja").exists():  # read for a chat template
            (path / "chat_template.jinja").write_text("{{ eos_token }}")
        argv.append("--chat")
    assert outcome(generate.main, argv, capsys) == "refused"
    generate.main(argv)
    assert names in capsys.readouterr().err
    if "--chat" not in argv and "eos" not in damage:  # what eval reads too
        (tmp_path / "data.txt").write_text(TEXT)
        argv = [str(path), "--data", str(tmp_path / "data.txt"), "--length", "8", "--quiet"]
        assert outcome(evaluate.main, argv, capsys) == "refused"
        evaluate.main(argv)
        assert names in capsys.readouterr().err


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_any_text_for_any_flag_keeps_the_promise(data, folder, tmp_path_factory, capsys):
    """Beyond the hand-picked values: any text (control characters, other scripts,
    numbers in words) for any flag of train or generate is refused in one line or
    accepted, never a traceback."""
    tmp = tmp_path_factory.mktemp("any")
    (tmp / "data.txt").write_text(TEXT)
    module, base = data.draw(
        st.sampled_from([
            (train, ["--config", "tiny", "--length", "8", "--batch", "2", "--steps", "2",
                     "--quiet", "--data", str(tmp / "data.txt"), "--out", str(tmp / "run")]),
            (generate, [str(folder), "--max-new", "2", "--prompt", "ab"]),
        ])
    )  # fmt: skip
    actions = [a for a in parser_of(module)._actions if a.option_strings and a.nargs != 0]
    flag = data.draw(st.sampled_from([a.option_strings[-1] for a in actions]))
    value = data.draw(st.text(max_size=12).filter(lambda v: "\x00" not in v))
    jax.jit, saved = compiling, jax.jit  # hypothesis' examples share the function's fixtures
    try:
        got = outcome(module.main, [*base, flag, value], capsys)
    finally:
        jax.jit = saved
    assert got in ("refused", "compiles"), (flag, value, got)
