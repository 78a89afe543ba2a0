"""What a killed write leaves beside its target is cleared by the next write (or read of
a folder): the writer's temporaries, and the previous folder a kill between
replace_folder's two renames left aside. Kills here are real SIGKILLs of a child."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from models.io import files, hub

# a child that replaces OUT's folder and a file, and is SIGKILLed at its Nth os.replace
CHILD = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from models.io import files
    out, kill_at = Path(sys.argv[1]), int(sys.argv[2])
    real, calls = os.replace, []
    def replace(a, b):
        calls.append(a)
        if len(calls) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        real(a, b)
    os.replace = replace
    files.write_atomic(out.with_name("note.txt"), "new")
    files.replace_folder(out, lambda d: (d / "config.json").write_text('{"new": 1}'))
""")


OLD = '{"model_type": "gpt2"}'


def killed_at(out: Path, call: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run([sys.executable, "-c", CHILD, str(out), str(call)], env=env)
    assert done.returncode == -signal.SIGKILL


@pytest.fixture
def folder(tmp_path) -> Path:
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text(OLD)
    (tmp_path / "note.txt").write_text("old")
    return out


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_a_kill_between_the_folder_renames_is_put_back_by_the_next_read(folder, capsys):
    killed_at(folder, 3)  # 1: the note's rename; 2: old folder aside; 3: new one in place
    assert not folder.exists() and ".export.old" in leftovers(folder.parent)
    assert hub.read_config(folder) == ("gpt2", {"model_type": "gpt2"})
    assert "put back its previous contents" in capsys.readouterr().err
    assert leftovers(folder.parent) == []  # the dead child's temporaries went too


def test_a_killed_writes_temporaries_go_at_the_next_write_and_others_stay(folder):
    killed_at(folder, 1)  # killed before the note's rename: its temporary file stays
    (dead,) = [n for n in leftovers(folder.parent) if n.startswith(".note.txt.")]
    killed_at(folder, 2)  # the new folder written, killed before anything moved
    assert [n for n in leftovers(folder.parent) if n.startswith(".export.")]
    host = socket.gethostname()
    alive = folder.with_name(f".export.{host}-{os.getppid()}.live.tmp")  # a writer running
    foreign = folder.with_name(".export.otherhost-1.x.tmp")  # another host's: unknowable
    for p in (alive, foreign):
        p.mkdir()
    files.write_atomic(folder.with_name("note.txt"), "newer")
    files.replace_folder(folder, lambda d: (d / "config.json").write_text("{}"))
    assert leftovers(folder.parent) == sorted([alive.name, foreign.name])
    assert (folder / "config.json").read_text() == "{}"
    assert folder.with_name("note.txt").read_text() == "newer"


def test_ctrl_c_between_the_renames_puts_the_old_folder_back(tmp_path, monkeypatch):
    """KeyboardInterrupt (not an OSError) after the old folder is renamed aside and
    before the new one is renamed in: the old folder is back, the interrupt goes on."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(OLD)
    real, calls = os.replace, []

    def replace(a, b):
        calls.append(a)
        if len(calls) == 2:  # the new folder's rename into place
            raise KeyboardInterrupt
        real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        files.replace_folder(out, lambda d: (d / "config.json").write_text('{"new": 1}'))
    monkeypatch.undo()
    assert (out / "config.json").read_text() == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
