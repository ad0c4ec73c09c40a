"""longshield_fx.cli.documents: private documents as (N, R, T) privacy units."""
import json
import os

import pytest
import torch

from longshield_fx.errors import DataError
from longshield_fx.documents import Documents, load_documents


def enc(s):
    return list(s.encode())


T, PAD = 8, 0


def load(path, max_rows=4, seq_len=T):
    return load_documents(path, enc, seq_len=seq_len, max_rows=max_rows, pad_id=PAD)


def unit_rows(text, rows, seq_len=T):
    """Hand-built (ids, labels) of shape (rows, seq_len) for a list of document texts."""
    ids = torch.full((rows, seq_len), PAD, dtype=torch.long)
    labels = torch.full((rows, seq_len), -100, dtype=torch.long)
    r = 0
    for doc in text:
        b = list(doc.encode())
        for start in range(0, len(b), seq_len):
            piece = torch.tensor(b[start:start + seq_len])
            ids[r, :len(piece)] = piece
            labels[r, :len(piece)] = piece
            r += 1
    return ids, labels


def write_jsonl(path, objs):
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


# --- directory -----------------------------------------------------------------------------

@pytest.fixture
def tree(tmp_path):
    d = tmp_path / "data"
    (d / "sub" / "deeper").mkdir(parents=True)
    (d / ".git").mkdir()
    (d / "b.txt").write_text("0123456789ABCDEFGHI")  # 19 bytes: 3 rows (8 + 8 + 3)
    (d / "a.txt").write_text("hello")  # 1 row
    (d / "sub" / "deeper" / "c.md").write_text("é-ok")  # UTF-8, 5 bytes
    (d / "sub" / "latin1.txt").write_bytes("café".encode("latin-1"))  # not UTF-8: skipped
    (d / "empty.txt").write_bytes(b"")  # skipped as empty
    (d / "one.txt").write_text("x")  # 1 token: skipped as empty
    (d / ".hidden").write_text("secret hidden file")  # hidden: not even counted
    (d / ".git" / "config").write_text("in a hidden directory")
    return d


def test_directory_rows_labels_and_skips(tree):
    docs = load(tree)
    assert docs.units == ["a.txt", "b.txt", "sub/deeper/c.md"]
    assert docs.ids.shape == docs.labels.shape == (3, 3, T)
    assert docs.ids.dtype == docs.labels.dtype == torch.long
    for i, text in enumerate(["hello", "0123456789ABCDEFGHI", "é-ok"]):
        ids, labels = unit_rows([text], 3)
        assert torch.equal(docs.ids[i], ids), docs.units[i]
        assert torch.equal(docs.labels[i], labels), docs.units[i]
    # b.txt by hand: two full rows, a 3-token row, padding -100
    assert docs.ids[1, 2].tolist() == [ord("G"), ord("H"), ord("I")] + [PAD] * 5
    assert docs.labels[1, 2].tolist() == [ord("G"), ord("H"), ord("I")] + [-100] * 5
    assert (docs.labels[0, 1:] == -100).all()  # a.txt's all-padding rows
    assert docs.num_units == 3 and docs.num_rows == 5 and docs.num_tokens == 5 + 19 + 5
    s = docs.stats()
    assert s == {"documents": 3, "units": 3, "rows": 5, "rows_per_unit": 3, "seq_len": T,
                 "tokens_kept": 29, "tokens_total": 29, "truncated_units": 0, "tokens_dropped": 0,
                 "padding_fraction": round(1 - 29 / (3 * 3 * T), 6),
                 "skipped": {"non_utf8": 1, "empty": 2, "same_file": 0, "same_dir": 0},
                 "skipped_names": {"non_utf8": ["sub/latin1.txt"], "empty": ["empty.txt", "one.txt"]},
                 "source": str(tree)}
    # The skipped files are named, not only counted.
    assert docs.describe() == ("3 units (3 documents), 29 tokens in 5 rows of 8, 3 rows per unit; 0 units truncated "
                               "(0 tokens dropped); 3 files skipped (binary or non-UTF-8: 1, empty: 2, one file reached "
                               "twice: 0); binary or not UTF-8: sub/latin1.txt; empty or under 2 tokens: empty.txt, one.txt")


def test_skipped_files_past_the_first_few_are_counted(tmp_path):
    for i in range(7):
        (tmp_path / f"{i}.bin").write_bytes(b"\xff\xfe\xfa")
    (tmp_path / "ok.txt").write_text("fine text")
    assert load(tmp_path).describe().endswith("not UTF-8: 0.bin, 1.bin, 2.bin, 3.bin, 4.bin and 2 more")


def test_a_file_mostly_of_nul_or_control_bytes_is_skipped_and_named_like_a_binary_file(tmp_path):
    """4,096 NUL bytes are valid UTF-8 and no text: skipped and named with the files that are not
    UTF-8. A text with colour escapes, a form feed or a few NUL bytes stays a document."""
    (tmp_path / "zeros").write_bytes(b"\0" * 4096)
    (tmp_path / "controls.dat").write_bytes(bytes(range(1, 9)) * 100 + b"some text")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "log.txt").write_bytes(b"\x1b[31mred\x1b[0m text, a form feed\x0c, a tab\t and \0\0 two NULs")
    docs = load(tmp_path)
    assert docs.units == ["log.txt"]
    assert docs.skipped["non_utf8"] == 3
    assert docs.describe().endswith("binary or not UTF-8: controls.dat, latin1.txt, zeros")


def test_pad_id_is_not_the_token_mask(tmp_path):
    (tmp_path / "z.txt").write_bytes(b"a\x00b")  # a real byte 0 = pad_id
    docs = load(tmp_path)
    assert docs.ids[0, 0, :3].tolist() == [97, 0, 98]
    assert docs.labels[0, 0, :4].tolist() == [97, 0, 98, -100]
    assert docs.num_tokens == 3


def test_a_tokenizer_without_a_pad_token_pads_with_0_and_a_bad_pad_id_is_named(tmp_path):
    """Llama's and GPT-2's tokenizers have ``pad_token_id = None``: what the README's recipe passes."""
    (tmp_path / "a.txt").write_bytes(b"abc")
    none = load_documents(tmp_path, enc, seq_len=T, max_rows=1, pad_id=None)
    assert none.ids[0, 0].tolist() == [97, 98, 99, 0, 0, 0, 0, 0] and none.labels[0, 0, 3:].eq(-100).all()
    with pytest.raises(DataError, match="pad_id must be a token id"):
        load_documents(tmp_path, enc, seq_len=T, max_rows=1, pad_id="<pad>")


def test_deterministic(tree):
    a, b = load(tree), load(tree)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.labels, b.labels) and a.units == b.units


# --- truncation and R ---------------------------------------------------------------------

def test_truncation_by_max_rows(tree):
    docs = load(tree, max_rows=2)
    assert docs.ids.shape == (3, 2, T)
    assert docs.truncated_units == 1 and docs.tokens_dropped == 3  # b.txt loses "GHI"
    assert docs.ids[1].flatten().tolist() == list(b"0123456789ABCDEF")
    s = docs.stats()
    assert (s["truncated_units"], s["tokens_dropped"], s["tokens_kept"], s["tokens_total"]) == (1, 3, 26, 29)
    assert "1 units truncated (3 tokens dropped)" in docs.describe()


def test_rows_per_unit_shrinks_to_longest_unit(tmp_path):
    (tmp_path / "a").write_text("short")
    (tmp_path / "b").write_text("0123456789")  # 2 rows
    docs = load(tmp_path, max_rows=64)
    assert docs.ids.shape == (2, 2, T) and docs.stats()["rows_per_unit"] == 2
    docs = load(tmp_path, max_rows=64, seq_len=16)
    assert docs.ids.shape == (2, 1, 16)


# --- jsonl -------------------------------------------------------------------------------------

def test_jsonl_shared_ids_form_one_unit(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "alice", "text": "alice one 12"},  # 12 bytes: 2 rows
        {"id": "bob", "text": "bob's"},
        "",  # blank line: skipped, still counted in line numbers
        {"id": 7, "text": "seven"},
        {"id": "alice", "text": "alice 2"},  # joins alice's unit: 1 more row
        {"id": "7", "text": "7 again"},  # "7" and 7 are one unit
        {"id": "carol", "text": "x"},  # 1 token: skipped as empty
        {"id": "dan", "text": "dan's text"},
    ])
    docs = load(f)
    assert docs.units == ["alice", "bob", "7", "dan"]
    assert docs.documents_per_unit == [2, 1, 2, 1]
    assert docs.ids.shape == (4, 3, T)
    for i, texts in enumerate([["alice one 12", "alice 2"], ["bob's"], ["seven", "7 again"], ["dan's text"]]):
        ids, labels = unit_rows(texts, 3)
        assert torch.equal(docs.ids[i], ids) and torch.equal(docs.labels[i], labels), docs.units[i]
    assert docs.ids[0, 2].tolist()[:7] == list(b"alice 2")  # second document starts a fresh row
    s = docs.stats()
    assert s["documents"] == 6 and s["units"] == 4 and s["skipped"] == {"non_utf8": 0, "empty": 1, "same_file": 0, "same_dir": 0}
    assert "1 lines skipped" in docs.describe()


def test_jsonl_without_ids_makes_each_line_a_unit(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "first"}, {"text": "second", "lang": "en"}])
    assert load(f).units == ["line 1", "line 2"]


def test_jsonl_ids_are_normalised_so_one_person_is_one_unit(tmp_path):
    """Case, surrounding whitespace and Unicode normalisation (NFC vs NFD) never split a person."""
    nfc, nfd = "Jos\u00e9", "Jose\u0301"
    f = write_jsonl(tmp_path / "d.jsonl", [{"id": i, "text": f"doc {k}"} for k, i in enumerate(
        ["alice", "Alice", "alice ", " alice", "ALICE\t", nfc, nfd, "jos\u00c9", 12, " 12 "])])
    docs = load(f)
    assert docs.units == ["alice", "jos\u00e9", "12"]
    assert docs.documents_per_unit == [5, 3, 2]


@pytest.mark.parametrize("variants, name", [
    (["alice", "Alice", "ALICE", " alice ", "alice\t", "ali\u200bce", "\uff41\uff4c\uff49\uff43\uff45"], "alice"),
    (["Jos\u00e9", "Jose\u0301", "JOS\u00c9", "\u00a0jose\u0301 "], "jos\u00e9"),  # NFC, NFD, case, NBSP
    (["alice\u00a0smith", "alice smith", "alice  smith", "Alice \u00a0Smith", "alice\u2003smith",
      "alice \u00adsmith"], "alice smith"),  # NBSP, double space, em space, a soft hyphen
    ([5, "5", " 5", "\uff15"], "5"),  # an int, its decimal string, a fullwidth digit
])
def test_jsonl_unit_id_variants_are_one_unit(tmp_path, variants, name):
    """Every way of writing one person's id (run_core.canonical_unit_id) names ONE unit."""
    f = write_jsonl(tmp_path / "d.jsonl", [{"id": v, "text": f"doc {k}"} for k, v in enumerate(variants)])
    docs = load(f, max_rows=16)
    assert docs.units == [name] and docs.documents_per_unit == [len(variants)] and docs.unit_key == "id"
    ids, labels = unit_rows([f"doc {k}" for k in range(len(variants))], len(variants))  # a row per document
    assert torch.equal(docs.ids[0], ids) and torch.equal(docs.labels[0], labels)


def test_jsonl_ids_that_differ_in_more_than_spelling_stay_apart(tmp_path):
    """Leading zeros are kept (an id scheme may use both "5" and "05"); spaces inside letters are not removed."""
    f = write_jsonl(tmp_path / "d.jsonl", [{"id": i, "text": f"doc {k}"} for k, i in enumerate(
        ["5", "05", 5, "alice", "a l i c e", "alicesmith", "alice smith"])])
    docs = load(f)
    assert docs.units == ["5", "05", "alice", "a l i c e", "alicesmith", "alice smith"]
    assert docs.documents_per_unit == [2, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("lines, phrase, line", [
    ([{"id": "a", "text": "one"}, {"text": "no id"}], 'no "id" field, while other lines have one', 2),
    ([{"text": "one", "ID": "alice"}, {"text": "two", "ID": "alice"}], 'id-like "ID"', 1),
    ([{"text": "one", "user_id": 3}], 'id-like "user_id": if it names the privacy unit pass it', 1),
    ([{"text": "one", "userId": 3}], 'id-like "userId"', 1),
    (['{"id": "alice", "text": "one", "id": "bob"}'], 'the key "id" appears twice', 1),
    ([{"id": "   ", "text": "one"}], '"id" is empty', 1),
    ([{"id": "a", "text": "one"}, {"id": "\u200b\u00a0", "text": "two"}], '"id" is empty', 2),  # invisible only
])
def test_jsonl_unit_ids_that_could_split_a_person_are_refused(tmp_path, lines, phrase, line):
    f = write_jsonl(tmp_path / "d.jsonl", lines)
    with pytest.raises(DataError) as e:
        load(f)
    assert phrase in str(e.value) and f"{f}:{line}:" in str(e.value)


@pytest.mark.parametrize("key", ["author", "user", "email", "patient", "person", "name", "subject", "user_name",
                                 "author_email", "userName", "authorEmail", "e-mail", "first_name", "Patient",
                                 "username", "sender"])
def test_jsonl_person_like_key_without_unit_key_is_refused(tmp_path, key):
    """A line naming its person under another key would otherwise train as a unit of its own."""
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "first note", key: "Alice"}, {"text": "second note", key: "alice"}])
    with pytest.raises(DataError) as e:
        load(f)
    assert str(e.value) == (f'{f}:1: no "id" field but a person-like "{key}": if it names the privacy unit pass it as '
                            f"the unit key (--unit-key {key}); to make each line its own unit, pass --unit-key none")
    assert "\n" not in str(e.value)
    # Both ways out work: the key names the unit, or each line is its own unit.
    by_key = load_documents(f, enc, seq_len=T, max_rows=4, pad_id=PAD, unit_key=key)
    assert by_key.units == ["alice"] and by_key.documents_per_unit == [2]
    by_line = load_documents(f, enc, seq_len=T, max_rows=4, pad_id=PAD, unit_key=None)
    assert by_line.units == ["line 1", "line 2"]


def test_jsonl_keys_that_name_no_person_are_not_refused(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "one", "title": "t", "file_name": "a.txt", "lang": "en",
                                            "source": "web", "model_name": "m", "date": "2024"}, {"text": "two"}])
    assert load(f).units == ["line 1", "line 2"]


def test_jsonl_refusal_quotes_a_key_the_shell_would_split(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "one", "author name": "alice"}])
    with pytest.raises(DataError, match="person-like \"author name\": .*\\(--unit-key 'author name'\\);"):
        load(f)


def test_jsonl_unit_key_names_the_field_or_none_for_one_unit_per_line(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "one", "user_id": "A"}, {"text": "two", "user_id": "a"},
                                           {"text": "three", "user_id": "b"}])
    by_user = load_documents(f, enc, seq_len=T, max_rows=4, pad_id=PAD, unit_key="user_id")
    assert by_user.units == ["a", "b"] and by_user.documents_per_unit == [2, 1]
    by_line = load_documents(f, enc, seq_len=T, max_rows=4, pad_id=PAD, unit_key=None)
    assert by_line.units == ["line 1", "line 2", "line 3"]


def test_directory_reads_one_file_reached_twice_once(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.txt").write_text("alice's record")
    (d / "b.txt").symlink_to(d / "a.txt")
    os.link(d / "a.txt", d / "c.txt")
    (d / "d.txt").write_text("bob's record")
    docs = load(d)
    assert docs.units == ["a.txt", "d.txt"]
    assert docs.skipped["same_file"] == 2 and "one file reached twice: 2" in docs.describe()


def test_directory_follows_a_symlinked_folder_once_and_names_loops(tmp_path):
    d, outside = tmp_path / "data", tmp_path / "outside"
    (d / "sub").mkdir(parents=True)
    (outside / "deep").mkdir(parents=True)
    (d / "a.txt").write_text("top level")
    (d / "sub" / "s.txt").write_text("in a real folder")
    (outside / "o.txt").write_text("linked in")
    (outside / "deep" / "x.txt").write_text("linked, deeper")
    (d / "linked").symlink_to(outside, target_is_directory=True)  # followed: its files are trained
    (d / "sub" / "loop").symlink_to(d, target_is_directory=True)  # the root again: not followed
    (d / "up").symlink_to(tmp_path, target_is_directory=True)  # contains the root: a loop
    (d / "z_again").symlink_to(outside, target_is_directory=True)  # read already, as linked/
    docs = load(d)
    assert docs.units == ["a.txt", "linked/deep/x.txt", "linked/o.txt", "sub/s.txt"]  # relative path order
    ids, labels = unit_rows(["linked, deeper"], docs.rows_per_unit)
    assert torch.equal(docs.ids[1], ids) and torch.equal(docs.labels[1], labels)
    assert docs.skipped == {"non_utf8": 0, "empty": 0, "same_file": 0, "same_dir": 3}
    assert docs.skipped_names == {"same_dir": ["sub/loop", "up", "z_again"]}
    assert docs.describe().endswith(
        "0 files skipped (binary or non-UTF-8: 0, empty: 0, one file reached twice: 0), 3 symlinked folders not followed; "
        "a symlink loop or a folder read once already: sub/loop, up, z_again")


def test_directory_reads_a_folder_reached_twice_under_its_first_path(tmp_path):
    d = tmp_path / "data"
    (d / "real").mkdir(parents=True)
    (d / "real" / "r.txt").write_text("one record")
    (d / "b" / "c").mkdir(parents=True)
    (d / "a_link").symlink_to(d / "real", target_is_directory=True)  # "a_link" < "real": read there
    (d / "b" / "c" / "l").symlink_to(d / "real", target_is_directory=True)
    (d / "b" / "c" / "f.txt").symlink_to(d / "real" / "r.txt")  # a file link: read once already
    docs = load(d)
    assert docs.units == ["a_link/r.txt"] and docs.documents_per_unit == [1]
    assert docs.skipped_names == {"same_dir": ["b/c/l", "real"], "same_file": ["b/c/f.txt"]}


def test_jsonl_truncation_across_documents_of_one_unit(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"id": 1, "text": "a" * 12}, {"id": 1, "text": "b" * 9},
                                           {"id": 2, "text": "cc"}])
    docs = load(f, max_rows=3)
    assert docs.ids.shape == (2, 3, T)
    assert docs.ids[0, 2].tolist() == list(b"bbbbbbbb")  # the second document keeps one row of its two
    assert docs.truncated_units == 1 and docs.tokens_dropped == 1
    docs = load(f, max_rows=2)  # the second document is dropped whole
    assert docs.tokens_dropped == 9 and docs.documents_per_unit == [2, 1] and docs.num_rows == 3


@pytest.mark.parametrize("line, phrase", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"id": 1}', 'no "text" field'),
    ('{"text": 5}', '"text" is int'),
    ('{"text": "ok", "id": null}', '"id" must be a string or an integer'),
    ('{"text": "ok", "id": 1.5}', '"id" must be a string or an integer'),
    ('{"text": "ok", "id": true}', '"id" must be a string or an integer'),
])
def test_jsonl_bad_lines_name_file_and_line(tmp_path, line, phrase):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, "", line])
    with pytest.raises(DataError) as e:
        load(f)
    assert phrase in str(e.value) and f"{f}:3:" in str(e.value)


# --- txt -----------------------------------------------------------------------------------------

def test_txt_one_document_per_line(tmp_path):
    f = tmp_path / "d.txt"
    f.write_bytes(b"first line\r\n\n   \nsecond\nz\n")
    docs = load(f)
    assert docs.units == ["line 1", "line 4"]
    for i, text in enumerate(["first line", "second"]):
        ids, labels = unit_rows([text], 2)
        assert torch.equal(docs.ids[i], ids) and torch.equal(docs.labels[i], labels)
    assert docs.skipped == {"non_utf8": 0, "empty": 1, "same_file": 0, "same_dir": 0}  # "z"


# --- errors --------------------------------------------------------------------------------------

def test_errors(tmp_path):
    with pytest.raises(DataError, match="no such file or directory.*expected a directory"):
        load(tmp_path / "missing")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported input '.csv'; expected"):
        load(tmp_path / "d.csv")
    (tmp_path / "bad.txt").write_bytes(b"ok line\n\xff\xfe\n")
    with pytest.raises(DataError, match="not valid UTF-8 \\(line 2"):
        load(tmp_path / "bad.txt")
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "\xe9"}\n')
    with pytest.raises(DataError, match="not valid UTF-8"):
        load(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no usable document"):
        load(tmp_path / "empty.jsonl")
    empty_dir = tmp_path / "nothing"
    empty_dir.mkdir()
    with pytest.raises(DataError, match="nothing: no usable document"):
        load(empty_dir)
    skips = tmp_path / "skips"
    skips.mkdir()
    (skips / "l1").write_bytes(b"\xff\xff")
    (skips / "e").write_bytes(b"")
    with pytest.raises(DataError, match="1 skipped as binary or not UTF-8, 1 skipped as empty"):
        load(skips)
    with pytest.raises(DataError, match="sequence length must be >= 2"):
        load(tmp_path / "d.txt", seq_len=1)
    with pytest.raises(DataError, match="rows per unit must be >= 1"):
        load(tmp_path / "d.txt", max_rows=0)


# --- split ---------------------------------------------------------------------------------------

@pytest.fixture
def ten(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"id": i % 10, "text": f"doc {i} of unit {i % 10}"} for i in range(20)])
    return load(f)


def test_split_by_units(ten):
    assert ten.num_units == 10
    train, ev = ten.split(0.25, seed=3)
    assert (train.num_units, ev.num_units) == (8, 2)  # round(2.5) = 2
    assert set(train.units).isdisjoint(ev.units) and set(train.units) | set(ev.units) == set(ten.units)
    assert train.ids.shape[1:] == ev.ids.shape[1:] == ten.ids.shape[1:]
    for part in (train, ev):
        assert part.units == sorted(part.units, key=ten.units.index)  # file order kept
        for j, name in enumerate(part.units):
            i = ten.units.index(name)
            assert torch.equal(part.ids[j], ten.ids[i]) and torch.equal(part.labels[j], ten.labels[i])
            assert part.documents_per_unit[j] == 2
    assert train.num_tokens + ev.num_tokens == ten.num_tokens
    again = ten.split(0.25, seed=3)
    assert again[0].units == train.units and again[1].units == ev.units
    assert any(ten.split(0.25, seed=s)[1].units != ev.units for s in range(4, 20))


def test_split_bounds(ten, tmp_path):
    assert ten.split(0.01, seed=0)[1].num_units == 1  # at least 1 eval unit
    assert ten.split(0.99, seed=0)[0].num_units == 1  # at least 1 train unit
    for bad in (0, 1, -0.5, 1.5, float("nan")):
        with pytest.raises(DataError, match="between 0 and 1"):
            ten.split(bad, seed=0)
    (tmp_path / "one.txt").write_text("a single document\n")
    with pytest.raises(DataError, match="cannot split 1 unit"):
        load(tmp_path / "one.txt").split(0.5, seed=0)


# --- into the sampler ----------------------------------------------------------------------------

def test_dataset_feeds_poisson_batches(ten):
    from longshield_fx.data import PoissonBatches

    R = ten.rows_per_unit
    with pytest.warns(Warning):
        batches = PoissonBatches(ten.dataset(), sample_rate=0.5, physical_batch_size=2, insecure_seed=0)
    assert batches.num_examples == 10
    seen = 0
    for batch in batches:
        for (ids, labels), mask in batch.physical:
            assert ids.shape == labels.shape == (2, R, T) and mask.shape == (2,)
        seen += batch.size
    assert seen > 0
