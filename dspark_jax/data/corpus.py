"""Local corpora as TFDS datasets stored in ``array_record`` files, read back with grain.

TFDS 4.9.10 builds ``GeneratorBasedBuilder`` datasets with ``file_format="array_record"``
without TensorFlow installed (checked: ``tensorflow`` is never imported), so these are real
TFDS builders: the output directory ``<data_dir>/<builder_name>/<version>/`` has the usual
``dataset_info.json`` / ``features.json`` and one array_record file per split and shard, and
can be reopened with ``tfds.builder_from_directory``. Reading is random access
(``as_data_source``), which grain needs for global shuffling, sharding and a checkpointable
iterator state that is just an index.

Splits: ``train`` and ``heldout``. Documents are assigned by a stable hash of their relative
path (``sha1(path) mod 100 < heldout_percent``), so the split never depends on file order,
the machine, or how many files exist.
"""

from __future__ import annotations

import glob
import hashlib
import inspect
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grain
import tensorflow_datasets as tfds
from etils import epath

TRAIN = "train"
HELDOUT = "heldout"
SPLITS = (TRAIN, HELDOUT)
DEFAULT_HELDOUT_PERCENT = 2
_SKIP_DIRS = frozenset({"site-packages", "__pycache__", ".git"})


def default_stdlib_root() -> Path:
    """The running Python's standard-library source directory (DESIGN §8)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _source_id(path: Path) -> str:
    return str(Path(path).resolve())


def _hash_bucket(key: str) -> int:
    # sha1 rather than hash(): Python's str hash is salted per process.
    return int(hashlib.sha1(key.encode("utf-8")).hexdigest(), 16) % 100


def assign_splits(keys: list[str], heldout_percent: float) -> dict[str, list[str]]:
    """Stable train/heldout assignment of document keys.

    ``bucket(key) < heldout_percent`` goes to heldout. TFDS refuses to write an empty split,
    so if no key lands in heldout the one with the smallest sha1 is moved there (still a
    pure function of the key set).
    """
    if not 0 < heldout_percent < 100:
        raise ValueError(f"heldout_percent must be in (0, 100), got {heldout_percent}")
    if len(keys) < 2:
        raise ValueError(f"need at least 2 documents for a train/heldout split, got {len(keys)}")
    held = [k for k in keys if _hash_bucket(k) < heldout_percent]
    if not held:
        held = [min(keys, key=lambda k: hashlib.sha1(k.encode("utf-8")).hexdigest())]
    if len(held) == len(keys):
        raise ValueError("every document fell into heldout; lower heldout_percent")
    held_set = set(held)
    return {
        TRAIN: sorted(k for k in keys if k not in held_set),
        HELDOUT: sorted(held),
    }


# ----------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------
class _LocalBuilder(tfds.core.GeneratorBasedBuilder):
    """Base for builders defined in this package (abstract, so TFDS does not register it).

    TFDS 4.9.10's ``code_path`` for a builder inside a package touches
    ``importlib_resources``, a backport it only declares for Python < 3.9, so on 3.11 it
    fails with ModuleNotFoundError. We have no checksums file or download, so the plain
    source file is all ``code_path`` needs to return.
    """

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(inspect.getfile(cls))

    # TFDS announces every build as "Downloading and preparing dataset ..." on stdout;
    # these builders read local files only, so say that (on stderr, beside the progress).
    def _log_download_bytes(self) -> None:
        print(f"building {self.name} from local files into {self.data_dir}", file=sys.stderr)

    def _log_download_done(self) -> None:
        print(f"built {self.name} in {self.data_dir}", file=sys.stderr)


class SourceTreeCorpus(_LocalBuilder):
    """Text files under a directory (default: the stdlib's ``*.py``), one record per file.

    Record: ``{"text": str, "path": str}`` with ``path`` relative to the root (posix).
    Directories named ``site-packages``/``__pycache__``/``.git`` are skipped; files that are
    not valid UTF-8 or are empty are skipped and counted in ``metadata.json``.
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def __init__(
        self,
        *,
        source: str | os.PathLike | None = None,
        suffixes: tuple[str, ...] = (".py",),
        heldout_percent: float = DEFAULT_HELDOUT_PERCENT,
        **kwargs,
    ):
        self._source = Path(source) if source is not None else default_stdlib_root()
        self._suffixes = tuple(suffixes)
        self._heldout_percent = heldout_percent
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=f"Files {self._suffixes} under {self._source}, one record per file.",
            features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "path": tfds.features.Text()}
            ),
            metadata=tfds.core.MetadataDict(
                source=_source_id(self._source),
                kind="source_tree",
                suffixes=list(self._suffixes),
                heldout_percent=self._heldout_percent,
            ),
        )

    def list_documents(self) -> list[str]:
        """Relative posix paths of candidate files, sorted (no content is read)."""
        root = self._source
        if not root.is_dir():
            raise FileNotFoundError(f"source tree {root} does not exist or is not a directory")
        out = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
            for name in filenames:
                if name.endswith(self._suffixes):
                    out.append(Path(dirpath, name).relative_to(root).as_posix())
        return sorted(out)

    def _split_generators(self, dl_manager):
        docs = self.list_documents()
        if len(docs) < 2:
            raise ValueError(
                f"empty corpus: found {len(docs)} file(s) matching {self._suffixes} under "
                f"{self._source} (need at least 2)"
            )
        self.info.metadata["skipped_non_utf8"] = 0
        self.info.metadata["skipped_empty"] = 0
        self.info.metadata["num_chars"] = {}
        splits = assign_splits(docs, self._heldout_percent)
        return {name: self._generate_examples(name, paths) for name, paths in splits.items()}

    def _generate_examples(self, split: str, paths: list[str]) -> Iterator[tuple[str, dict]]:
        meta = self.info.metadata
        chars = 0
        for rel in paths:
            try:
                text = (self._source / rel).read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                meta["skipped_non_utf8"] += 1
                continue
            if not text.strip():
                meta["skipped_empty"] += 1
                continue
            chars += len(text)
            yield rel, {"text": text, "path": rel}
        meta["num_chars"][split] = chars


def _jsonl_files(source: Path) -> list[Path]:
    if source.is_dir():
        return sorted(source.glob("*.jsonl"))
    if source.is_file():
        return [source]
    return sorted(Path(p) for p in glob.glob(str(source)))


def _jsonl_prompt(rec: Any, where: str) -> tuple[str, list[str]]:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    turns = rec.get("turns")
    if turns is None and isinstance(rec.get("prompt"), str):
        turns = [rec["prompt"]]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise ValueError(
            f"{where}: need a non-empty list of strings under 'turns' (or a 'prompt' string); "
            f"keys present: {sorted(rec)}"
        )
    return turns[0], turns


class JsonlPromptCorpus(_LocalBuilder):
    """Prompt sets in the ``eval_datasets/*.jsonl`` format: ``{"turns": [str, ...]}``.

    Record: ``{"text": prompt, "prompt": turns[0], "turns": [...], "response": str,
    "path": "<file>:<line>"}``. ``response`` is the record's ``response`` or ``output``
    field when present, else ``""``. ``text`` is the prompt (what a drafter's
    self-distillation run feeds the target). ``source`` may be a file, a directory (all its
    ``*.jsonl``) or a glob.
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def __init__(
        self,
        *,
        source: str | os.PathLike,
        heldout_percent: float = DEFAULT_HELDOUT_PERCENT,
        **kwargs,
    ):
        self._source = Path(source)
        self._heldout_percent = heldout_percent
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=f"Prompts from JSONL {self._source}.",
            features=tfds.features.FeaturesDict(
                {
                    "text": tfds.features.Text(),
                    "prompt": tfds.features.Text(),
                    "turns": tfds.features.Sequence(tfds.features.Text()),
                    "response": tfds.features.Text(),
                    "path": tfds.features.Text(),
                }
            ),
            metadata=tfds.core.MetadataDict(
                source=_source_id(self._source),
                kind="jsonl",
                heldout_percent=self._heldout_percent,
            ),
        )

    def read_records(self) -> dict[str, dict]:
        """key ``<file>:<line>`` -> record, for every non-blank line of every file."""
        files = _jsonl_files(self._source)
        if not files:
            raise ValueError(f"empty corpus: no .jsonl files at {self._source}")
        records = {}
        for f in files:
            with open(f, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    where = f"{f}:{lineno}"
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{where}: invalid JSON ({e})") from e
                    prompt, turns = _jsonl_prompt(rec, where)
                    response = rec.get("response", rec.get("output", ""))
                    if not isinstance(response, str):
                        response = json.dumps(response)
                    key = f"{f.name}:{lineno}"
                    records[key] = {
                        "text": prompt,
                        "prompt": prompt,
                        "turns": turns,
                        "response": response,
                        "path": key,
                    }
        return records

    def _split_generators(self, dl_manager):
        records = self.read_records()
        if len(records) < 2:
            raise ValueError(
                f"empty corpus: {len(records)} record(s) in {self._source} (need at least 2)"
            )
        splits = assign_splits(sorted(records), self._heldout_percent)
        self.info.metadata["num_chars"] = {
            s: sum(len(records[k]["text"]) for k in keys) for s, keys in splits.items()
        }
        return {
            name: self._generate_examples([(k, records[k]) for k in keys])
            for name, keys in splits.items()
        }

    def _generate_examples(self, items):
        yield from items


BUILDERS = {"source_tree": SourceTreeCorpus, "jsonl": JsonlPromptCorpus}


def make_builder(
    kind: str, source: str | os.PathLike | None, data_dir: str | os.PathLike, **kwargs
) -> tfds.core.GeneratorBasedBuilder:
    if kind not in BUILDERS:
        raise ValueError(f"unknown corpus kind {kind!r}; expected one of {sorted(BUILDERS)}")
    if kind == "jsonl" and source is None:
        raise ValueError("corpus kind 'jsonl' needs a source (file, directory or glob)")
    return BUILDERS[kind](
        source=source, data_dir=str(data_dir), file_format="array_record", **kwargs
    )


def prepare_corpus(
    kind: str,
    source: str | os.PathLike | None,
    data_dir: str | os.PathLike,
    *,
    heldout_percent: float = DEFAULT_HELDOUT_PERCENT,
    overwrite: bool = False,
    progress: bool = False,
) -> dict[str, int]:
    """Builds the corpus into ``data_dir`` (reused if already built); returns split -> count.

    An existing build from a *different* source is an error unless ``overwrite=True``.
    """
    builder = make_builder(kind, source, data_dir, heldout_percent=heldout_percent)
    want = _source_id(builder._source)
    done = Path(builder.data_dir, "dataset_info.json").exists()
    if done and not overwrite:
        have = read_metadata(builder.data_dir).get("source")
        if have != want:
            raise ValueError(
                f"{builder.data_dir} already holds a corpus built from {have!r}, not {want!r}; "
                "pass overwrite=True (--overwrite) or use another data_dir"
            )
    tfds.display_progress_bar(progress)
    mode = (
        tfds.download.GenerateMode.REUSE_CACHE_IF_EXISTS
        if overwrite
        else tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS
    )
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(download_mode=mode))
    return {name: int(info.num_examples) for name, info in builder.info.splits.items()}


# ----------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------
def read_metadata(dataset_dir: str | os.PathLike) -> dict:
    p = Path(dataset_dir, "metadata.json")
    return json.loads(p.read_text()) if p.exists() else {}


def find_dataset_dir(data_dir: str | os.PathLike, name: str | None = None) -> Path:
    """Locates a built dataset: ``data_dir`` itself, or ``data_dir/<name>/<version>``.

    ``name`` is the builder name (``source_tree_corpus`` / ``jsonl_prompt_corpus``) or the
    kind (``source_tree`` / ``jsonl``); needed only when ``data_dir`` holds several.
    """
    root = Path(data_dir)
    if (root / "dataset_info.json").exists():
        return root
    if name in BUILDERS:
        name = BUILDERS[name].name
    pattern = f"{name or '*'}/*/dataset_info.json"
    found = sorted(p.parent for p in root.glob(pattern) if "incomplete" not in p.parent.name)
    if not found:
        raise FileNotFoundError(
            f"no prepared dataset under {root}"
            + (f" named {name!r}" if name else "")
            + " (run python -m dspark_jax.data.prepare first)"
        )
    if len(found) > 1:
        names = {p.parent.name for p in found}
        if len(names) > 1:
            raise ValueError(f"{root} holds several datasets {sorted(names)}; pass name=")
        found.sort(key=lambda p: tfds.core.Version(p.name))  # several versions: newest
    return found[-1]


def _to_str(x):
    if isinstance(x, bytes):
        return x.decode("utf-8")
    if isinstance(x, list | tuple):
        return [_to_str(v) for v in x]
    if hasattr(x, "tolist"):  # numpy array of bytes (Sequence(Text))
        return _to_str(x.tolist())
    return x


def _decode_record(rec: dict) -> dict:
    return {k: _to_str(v) for k, v in rec.items()}


def make_text_dataset(
    data_dir: str | os.PathLike,
    split: str,
    seed: int = 0,
    shuffle: bool = True,
    shard_index: int = 0,
    shard_count: int = 1,
    *,
    name: str | None = None,
) -> grain.MapDataset:
    """A grain ``MapDataset`` of decoded records (``str`` fields) for one host's shard.

    Sharding is strided (``records[shard_index::shard_count]``), applied before shuffling,
    so shards are disjoint, cover the split, and each host's order depends only on ``seed``.
    Apply ``.repeat(n)`` after this for several epochs (grain reshuffles each epoch).
    """
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index}/{shard_count}")
    ds_dir = find_dataset_dir(data_dir, name)
    return open_split(ds_dir, split, seed, shuffle, shard_index, shard_count).map(_decode_record)


def open_split(
    ds_dir, split: str, seed: int, shuffle: bool, shard_index: int, shard_count: int,
    max_records: int | None = None,
) -> grain.MapDataset:  # fmt: skip
    """One split of a prepared TFDS dataset as a (sharded, shuffled) grain ``MapDataset``.

    Sharding is strided and applied before shuffling: shards are disjoint, cover the
    split, and each host's order depends only on ``seed``. Records are not decoded.
    ``max_records`` keeps the split's first records in stored order (before sharding and
    shuffling); asking for more than the split holds is an error, not a silent shortfall.
    """
    builder = tfds.builder_from_directory(str(ds_dir))
    if split not in builder.info.splits:
        raise ValueError(
            f"split {split!r} not in {ds_dir}; available: {sorted(builder.info.splits)}"
        )
    source = builder.as_data_source(split=split)
    ds = grain.MapDataset.source(source)
    if max_records is not None:
        if not 0 < max_records <= len(source):
            raise ValueError(
                f"max_records = {max_records}: split {split!r} of {ds_dir} holds "
                f"{len(source)} records (need 1 <= max_records <= {len(source)})"
            )
        ds = ds[:max_records]
    if shard_count > 1:
        ds = ds[shard_index::shard_count]
        if len(ds) == 0:
            raise ValueError(
                f"shard {shard_index}/{shard_count} of {ds_dir} split {split!r} is empty "
                f"({len(source)} records for {shard_count} shards)"
            )
    if shuffle:
        ds = ds.shuffle(seed=seed)
    return ds
