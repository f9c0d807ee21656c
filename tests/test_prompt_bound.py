"""The cheap bound on a prompt's tokens (`engine.prompts.chat.min_tokens`) is ready when the
model is: a server's first requests must not each pass over the vocabulary (on an H200, 24
first chat turns waited 17 s for that pass, run at once from every request thread)."""

import ctypes

import llama_cpp as lc

import engine.llama.model as model_module
from engine.llama.model import Model
from engine.prompts.chat import min_tokens


def test_the_bound_needs_no_pass_over_the_vocabulary_after_load(tiny_path, monkeypatch):
    model = Model(tiny_path, "cpu")
    try:
        def no_pass(*_args):
            raise AssertionError("a token's piece was asked for after the model loaded")

        monkeypatch.setattr(model_module, "_token_to_piece", no_pass)
        monkeypatch.setattr(lc, "llama_token_to_piece", no_pass)
        text = "hello world " * 100
        assert 0 < min_tokens(model, [text]) <= len(text.encode())
    finally:
        monkeypatch.undo()
        model.close()


def test_the_longest_token_is_the_longest_piece_special_text_included(tiny_model):
    buf = ctypes.create_string_buffer(512)
    longest = max(abs(lc.llama_token_to_piece(tiny_model.vocab, t, buf, 512, 0, True))
                  for t in range(tiny_model.n_vocab))
    assert tiny_model.longest_token_bytes() == max(longest, 1)
