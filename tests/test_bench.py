"""WER normalisation and the bench report's arithmetic."""
from transcribe.bench import normalize_text, wer


def test_normalisation_matches_librispeech_style():
    assert normalize_text("Hello, World!  It's  'quoted' — ok.") == "hello world it's quoted ok"
    assert normalize_text("THERE'S IRON") == "there's iron"


def test_wer_counts_edits_over_reference_words():
    assert wer(["the cat sat", "a b"], ["The cat sat.", "a b"]) == 0.0
    assert abs(wer(["the cat sat on"], ["the bat sat"]) - 0.5) < 1e-9  # 1 sub + 1 del over 4
    assert wer([""], ["x"]) is None


def test_edit_distance_counts_insertions_deletions_substitutions():
    from transcribe.bench import edit_distance

    assert edit_distance(list("kitten"), list("sitting")) == 3
    assert edit_distance([], [1, 2]) == 2 and edit_distance([1, 2], []) == 2
    assert edit_distance([5, 6, 7], [5, 6, 7]) == 0
    assert edit_distance("the cat sat".split(), "the cat sat down".split()) == 1
