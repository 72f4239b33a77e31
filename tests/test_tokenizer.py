import sys

import numpy as np
import pytest

from data_pipeline.corpus import read_documents
from data_pipeline.errors import DataError, UsageError
from data_pipeline.tokenizer import SPECIAL_IDS, Tokenizer, train_tokenizer


def test_special_ids_fixed(small_shards):
    tk = Tokenizer(small_shards.tokenizer)
    assert tk.special_ids == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    assert [tk.id_to_piece(i) for i in range(5)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert tk.vocab_size == small_shards.vocab_size and tk.dtype == np.uint16


def test_roundtrip_and_byte_fallback(small_shards):
    tk = Tokenizer(small_shards.tokenizer)
    for d in read_documents(small_shards.source, limit=200):
        assert tk.decode(tk.encode(d.text)) == d.text
    rare = "𠀀龘 Hello World 123 [SEP] [MASK]"        # outside the vocabulary; literal special names
    ids = tk.encode(rare)
    assert tk.decode(ids) == rare
    assert not np.isin(ids, list(SPECIAL_IDS.values())).any()  # text never becomes a special id


def test_word_marks_from_gold_words(small_shards):
    tk = Tokenizer(small_shards.tokenizer)
    doc = next(iter(read_documents(small_shards.source)))
    ids = tk.encode(doc.text)
    marks = tk.word_marks(doc.text, ids, doc.words)
    assert marks.dtype == np.uint8 and len(marks) == len(ids) and marks[0] == 1
    # every word start that is also a token start is marked, and nothing else
    word_starts = set(np.cumsum([0] + [len(w) for w in doc.words[:-1]]).tolist())
    pieces = [tk.decode([i]) for i in ids]
    tok_starts = np.cumsum([0] + [len(p) for p in pieces[:-1]])
    assert [int(s in word_starts) for s in tok_starts] == marks.tolist()


def test_bpe_option_and_too_small_vocab(tmp_path, peoples_daily):
    texts = [d.text for d in read_documents(peoples_daily, limit=300)]
    model = train_tokenizer(texts, tmp_path / "bpe", vocab_size=3000, model_type="bpe", num_threads=2,
                            input_sentence_size=200)
    tk = Tokenizer(model)
    assert tk.sp.GetPieceSize() <= 3000 and tk.decode(tk.encode(texts[0])) == texts[0]
    with pytest.raises(UsageError, match="vocab_size: 300 is smaller than the characters"):
        train_tokenizer(texts, tmp_path / "small", vocab_size=300, num_threads=2)
    with pytest.raises(ValueError, match="model_type"):
        train_tokenizer(texts, tmp_path / "x", vocab_size=3000, model_type="wordpiece")


def test_jieba_missing_gives_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "jieba", None)  # as if not installed
    with pytest.raises(UsageError, match="pip install jieba"):
        train_tokenizer(["中文"], tmp_path / "j", vocab_size=1000, jieba=True)


def test_not_a_model(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(DataError, match="bad.model: not a SentencePiece model"):
        Tokenizer(bad)
    with pytest.raises(DataError, match="missing.model: no such file"):
        Tokenizer(tmp_path / "missing.model")


def test_batch_encoding_and_word_marks_equal_the_per_document_ones(small_shards, reviews):
    from data_pipeline.corpus import read_documents

    tk = Tokenizer(small_shards.tokenizer)
    docs = list(read_documents(small_shards.source, limit=300)) + list(read_documents(reviews[0], limit=300))
    docs.append(type(docs[0])("𠀀龘 Hello World123 [SEP]", None))          # byte fallback, ASCII runs
    texts = [d.text for d in docs]
    ids, lengths = tk.encode_flat(texts)
    marks = tk.word_marks_flat(ids, lengths, texts, [d.words for d in docs])
    assert any(d.words for d in docs) and any(d.words is None for d in docs)
    pos = 0
    for d, n in zip(docs, lengths.tolist()):
        assert ids[pos:pos + n].tolist() == tk.encode(d.text).tolist()
        assert marks[pos:pos + n].tolist() == tk.word_marks(d.text, ids[pos:pos + n], d.words).tolist()
        pos += n
    assert pos == len(ids)


def test_buffer_encoding_and_piece_tables_against_plain_sentencepiece(small_shards, reviews):
    """encode_flat through SentencePiece's int32 buffers gives Encode's ids, and the same with the buffers
    unavailable (an older sentencepiece); the word-start rule checked against the pieces' own strings."""
    from data_pipeline.corpus import read_documents

    tk = Tokenizer(small_shards.tokenizer)
    assert tk._buffers is not None                          # this sentencepiece has them: the path under test
    texts = [d.text for d in read_documents(reviews[0], limit=500)] + ["𠀀龘 Hello World123 [SEP]", "a1 b2▁c"]
    want = tk.sp.Encode(texts)
    ids, lengths = tk.encode_flat(texts)
    assert lengths.tolist() == [len(w) for w in want] and ids.tolist() == [i for w in want for i in w]
    plain = Tokenizer(small_shards.tokenizer)
    plain._buffers = None
    ids2, lengths2 = plain.encode_flat(texts)
    assert ids2.tolist() == ids.tolist() and lengths2.tolist() == lengths.tolist()
    # the rule in words: a piece continues the word before it when it is a UTF-8 continuation byte, or when it
    # starts with an ASCII letter/digit (no '▁') and the piece before ends with one
    sp = tk.sp
    for text in texts[-2:] + texts[:50]:
        got = tk.word_marks(text, tk.encode(text)).tolist()
        pieces = [sp.IdToPiece(i) for i in sp.Encode(text)]

        def alnum(ch):
            return ch.isascii() and ch.isalnum()

        def continues(prev, cur):
            if cur.startswith("<0x") and cur.endswith(">") and len(cur) == 6:
                return 0x80 <= int(cur[3:5], 16) < 0xC0
            if prev.startswith("<0x") or prev in ("[UNK]",) or cur in ("[UNK]",):
                return False
            return not cur.startswith("\u2581") and alnum(cur[0]) and alnum(prev[-1])

        assert got == [1] + [0 if continues(a, b) else 1 for a, b in zip(pieces, pieces[1:])], text
