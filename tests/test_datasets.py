"""What --data and --val-data read (models/training/datasets.py): text files and folders (binary
files refused by name, hidden folders skipped), memory-mapped .bin/.npy token ids checked
against the tokenizer, JSON lines, Parquet and datasets folders; a validation set apart;
each process reading only the batch rows its devices hold."""

import json

import jax
import numpy as np
import pytest

from lowering import Mesh
from models import catalog, zoo
from models.cli import train
from models.training import data, datasets
from models.training.trainer import Trainer

DOCS = ["first document\n", "second, with ünïcode\n", "third\n"]


def test_text_folders_skip_hidden_folders_and_refuse_binary_files(tmp_path):
    (tmp_path / "b.txt").write_text(DOCS[1])
    (tmp_path / "a.txt").write_text(DOCS[0])
    (tmp_path / ".git" / "objects").mkdir(parents=True)
    (tmp_path / ".git" / "objects" / "pack").write_bytes(b"\0\1\2PACK")
    (tmp_path / ".hidden.txt").write_text("not read")
    assert datasets.read(tmp_path) == DOCS[0] + DOCS[1]
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0")
    with pytest.raises(data.DataError, match=r"^--data .*sub/image.png: a binary file"):
        datasets.read(tmp_path)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(data.DataError, match="latin1.txt: a binary file"):
        datasets.read(tmp_path / "latin1.txt", "--val-data")


def test_token_files_are_memory_maps_of_their_ids(tmp_path):
    ids = np.arange(1000) % 300
    ids.astype(np.uint16).tofile(tmp_path / "train.bin")
    np.save(tmp_path / "ids.npy", ids.astype(np.int32))
    for name in ("train.bin", "ids.npy"):
        tokens = datasets.read(tmp_path / name)
        assert isinstance(tokens.ids, np.memmap)  # opened, not read
        np.testing.assert_array_equal(tokens.ids, ids)
        assert tokens.max() == 299
    (tmp_path / "odd.bin").write_bytes(b"\1\2\3")
    np.save(tmp_path / "2d.npy", np.zeros((2, 3), np.int32))
    np.save(tmp_path / "float.npy", np.zeros(3, np.float32))
    for name, says in [("odd.bin", "odd"), ("2d.npy", r"1-D"), ("float.npy", "float32")]:
        with pytest.raises(data.DataError, match=f"{name}.*{says}"):
            datasets.read(tmp_path / name)


def test_token_ids_beyond_the_vocabulary_are_refused_naming_the_file(tmp_path):
    np.save(tmp_path / "ids.npy", np.array([1, 2, 300] * 40, np.int64))
    with pytest.raises(data.DataError, match=r"ids.npy: holds token id 300.*256 ids"):
        data.Corpus(datasets.read(tmp_path / "ids.npy"), data.ByteTokenizer(), 8)


def test_json_lines_parquet_and_datasets_folders_read_their_text_field(tmp_path):
    rows = [{"text": d, "n": i} for i, d in enumerate(DOCS)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert datasets.read(tmp_path / "a.jsonl") == "\n".join(DOCS)
    with pytest.raises(data.DataError, match=r"a.jsonl:1: no 'body' field"):
        datasets.read(tmp_path / "a.jsonl", text_field="body")
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n[1]\n')
    with pytest.raises(data.DataError, match=r"bad.jsonl:2: a JSON line must be an object"):
        datasets.read(tmp_path / "bad.jsonl")
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.table({"text": DOCS, "n": [0, 1, 2]}), tmp_path / "a.parquet")
    assert datasets.read(tmp_path / "a.parquet") == "\n".join(DOCS)
    hf = pytest.importorskip("datasets")
    ds = hf.Dataset.from_dict({"text": DOCS})
    ds.save_to_disk(str(tmp_path / "ds"))
    assert datasets.read(tmp_path / "ds") == "\n".join(DOCS)
    hf.DatasetDict({"train": ds, "validation": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(data.DataError, match=r"several splits \(train, validation\).*dd/train"):
        datasets.read(tmp_path / "dd")


def test_a_validation_set_apart_is_used_whole(tmp_path):
    train_ids = np.arange(500) % 200
    val_ids = (np.arange(100) % 50) + 200
    corpus = data.Corpus(
        datasets.Tokens(train_ids, tmp_path / "t"),
        data.ByteTokenizer(),
        8,
        valid=datasets.Tokens(val_ids, tmp_path / "v"),
    )
    assert len(corpus.train) == 500  # not split
    (first,) = list(corpus.validation_batches(12, 1))
    np.testing.assert_array_equal(first["inputs"][0], val_ids[:8])
    np.testing.assert_array_equal(first["targets"][1], val_ids[9:17])


def test_each_process_reads_the_rows_its_devices_hold():
    cfg = zoo.get("lm").configure(catalog.get("tiny")).replace(batch=8, length=8)
    mesh = Mesh({"data": 4})
    split = Trainer(zoo.get("lm"), cfg, mesh, "batch:data")
    half = jax.devices()[:2]  # as if this process held the first two devices
    np.testing.assert_array_equal(split.local_rows(half), [0, 1, 2, 3])
    whole = Trainer(zoo.get("lm"), cfg, mesh, "")  # the batch on every device
    np.testing.assert_array_equal(whole.local_rows(half), np.arange(8))
    assert split.local_rows() is None  # one process: no share to cut
    corpus = data.Corpus(data.load_text()[:5000], data.ByteTokenizer(), 8)
    full, part = corpus.batch(3, 8, 0), corpus.batch(3, 8, 0, rows=[0, 1, 2, 3])
    np.testing.assert_array_equal(part["inputs"][:4], full["inputs"][:4])
    assert not part["inputs"][4:].any()


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--tokenizer", "bpe"], "--tokenizer bpe trains on text, but --data"),
        (["--val-data", "VAL"], "--val-data"),
    ],
)
def test_train_refuses_data_in_one_line(tmp_path, flags, says, capsys):
    (np.arange(4000) % 256).astype(np.uint16).tofile(tmp_path / "t.bin")
    np.save(tmp_path / "v.npy", np.array([5, 999] * 100))
    flags = [str(tmp_path / "v.npy") if f == "VAL" else f for f in flags]
    rc = train.main(["--data", str(tmp_path / "t.bin"), "--out", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and says in err[0], err
