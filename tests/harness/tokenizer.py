"""A word-level tokenizer built in memory for the tests whose clients need one (nothing downloaded)."""


def tiny_tokenizer():
    """A word-level tokenizer built in memory (nothing downloaded), and the words it knows."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(60)]
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{word: i + 3 for i, word in enumerate(words)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]"), words
