"""A `.nemo` that is broken inside (config, weights, tokenizer) is one error line naming the file
and the reason, for every command; and what NeMo reads from a config, we read the same way.
Each test builds its own modified copy of a fixture under tmp_path."""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Callable

import pytest
import yaml

from conftest import NEMO_REF, SPEECH, needs_shared
from engines.checkpoint import CheckpointError, NemoArchive

TDT = NEMO_REF / "tdt_tiny" / "model.nemo"
HYBRID = NEMO_REF / "tdt_ctc_tiny" / "model.nemo"


def rebuilt(dst: Path, src: Path = TDT, config: Callable[[dict], object] | None = None,
            members: dict[str, bytes] | None = None) -> Path:
    """A copy of the .nemo `src` at `dst`, its config edited in place by `config` (or replaced by
    the bytes it returns) and members whose names end with a key of `members` replaced."""
    with tarfile.open(src) as tar, tarfile.open(dst, "w") as out:
        for m in tar.getmembers():
            if not m.isfile():
                continue
            data = tar.extractfile(m).read()
            if m.name.endswith("model_config.yaml") and config is not None:
                cfg = yaml.safe_load(data)
                edited = config(cfg)
                data = edited if isinstance(edited, bytes) else yaml.safe_dump(cfg).encode()
            for suffix, new in (members or {}).items():
                if m.name.endswith(suffix):
                    data = new
            info = tarfile.TarInfo(m.name)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    return dst


def setter(section: str, key: str, value: object) -> Callable[[dict], None]:
    def edit(cfg: dict) -> None:
        cfg[section][key] = value
    return edit


def load(path: Path):
    from engines.parakeet import ParakeetEngine

    return ParakeetEngine.from_nemo(path, "cpu")


BROKEN = {  # name: (config edit or replaced member, what the one line says)
    "n_layers": (setter("encoder", "n_layers", 1), r"the weights do not match model_config\.yaml: \d+ unexpected "
                                                   r"\(first: encoder\.layers\.1\."),
    "d_model": (setter("encoder", "d_model", 128), r"weights do not match .*of another shape \(first: "
                                                   r"encoder\.pre_encode\.out\.weight is \[96, 320\] in the weights, "
                                                   r"\[128, 320\] by the config\)"),
    "kernel": (setter("encoder", "conv_kernel_size", 31), r"depthwise_conv\.weight is \[96, 1, 9\] in the weights"),
    "conv_norm": (setter("encoder", "conv_norm_type", "layer_norm"), r"unexpected \(first: encoder\.layers\.0\.conv\.batch_norm"),
    "extra_outputs": (setter("joint", "num_extra_outputs", 5), r"first: joint\.joint_net\.2\.weight is \[129, 64\]"),
    "yaml": (lambda cfg: b"encoder: [\n  d_model: 96\n", r"model_config\.yaml is not valid YAML \(line 3: "),
    "yaml_tab": (lambda cfg: b"sample_rate: 16000\n\tencoder: x\n", r"model_config\.yaml is not valid YAML \(line 2: "),
    "no_preprocessor": (lambda cfg: cfg.pop("preprocessor"), r"model_config\.yaml: section 'preprocessor' is missing"),
    "no_encoder": (lambda cfg: cfg.pop("encoder"), r"section 'encoder' is missing"),
    "encoder_list": (lambda cfg: cfg.update(encoder=[1, 2]), r"section 'encoder' is a list, not a mapping"),
    "beam": (setter("decoding", "strategy", "beam"), r"config key 'decoding\.strategy' = 'beam' is not supported"),
    "tokenizer": ({"tokenizer.model": b"garbage" * 10}, r"tokenizer member '.*tokenizer\.model' is not a SentencePiece model"),
}


@needs_shared
@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_checkpoint_is_one_checkpoint_error_naming_the_file(case, tmp_path):
    """Weights that do not fit the config, bad YAML, a missing section and a corrupt tokenizer
    raised RuntimeError (listing every key), yaml's, KeyError or AttributeError (tracebacks);
    a key we refuse raised a ValueError that named no file."""
    edit, says = BROKEN[case]
    path = rebuilt(tmp_path / f"{case}.nemo", **({"members": edit} if isinstance(edit, dict) else {"config": edit}))
    with pytest.raises(CheckpointError, match=f"^{path}: .*{says}") as caught:
        load(path)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transcribe.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, HF_HUB_OFFLINE="1"))


@needs_shared
@pytest.mark.parametrize("command", ["transcribe", "bench", "stream", "serve", "export-engine"])
def test_every_command_says_it_in_one_line_and_exits_1(command, tmp_path):
    """The documented exit status of a model that cannot load (1), one `error:` line naming the
    file, no traceback: the d_model mismatch was 40-110 lines of traceback in every command."""
    path = rebuilt(tmp_path / "d_model.nemo", config=setter("encoder", "d_model", 128))
    audio = str(SPEECH / "jfk" / "jfk.flac")
    args = {"transcribe": [audio, "--out", str(tmp_path / "out")], "bench": [audio],
            "stream": [audio], "serve": ["--port", "0"],
            "export-engine": ["--onnx-only", "--cache-dir", str(tmp_path / "cache")]}[command]
    p = cli(*([] if command == "transcribe" else [command]), *args, "--model", str(path))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr and lines[-1].startswith("error: ") and str(path) in lines[-1], p.stderr
    assert "the weights do not match model_config.yaml" in lines[-1]


def durations_of(path: Path) -> tuple[int, ...]:
    from engines.transducer import TransducerConfig

    with NemoArchive(path) as archive:
        return TransducerConfig.from_nemo(archive.config).durations


@needs_shared
def test_tdt_durations_come_from_the_loss_as_in_nemo(tmp_path):
    """NeMo's set_decoding_type_according_to_loss puts a TDT loss's durations in place of
    decoding.durations at every load: a checkpoint whose two lists differed decoded with the
    decoding's here, other text than NeMo's (checked against NeMo 3.0.0 while writing this)."""
    def other(section: str) -> Callable[[dict], None]:
        def edit(cfg: dict) -> None:
            (cfg["decoding"] if section == "decoding" else cfg["loss"]["tdt_kwargs"])["durations"] = [0, 1, 2, 4, 8]
        return edit

    assert durations_of(rebuilt(tmp_path / "d.nemo", config=other("decoding"))) == (0, 1, 2, 3, 4)
    assert durations_of(rebuilt(tmp_path / "l.nemo", config=other("loss"))) == (0, 1, 2, 4, 8)
    no_decoding_list = rebuilt(tmp_path / "n.nemo", config=lambda cfg: cfg["decoding"].pop("durations"))
    assert durations_of(no_decoding_list) == (0, 1, 2, 3, 4)  # was plain RNN-T decoding of a TDT model
    # Without a TDT loss, the decoding's list is the one (NeMo's "default" loss is RNN-T's).
    assert durations_of(rebuilt(tmp_path / "x.nemo", config=lambda cfg: (cfg.pop("loss"), other("decoding")(cfg)))) \
        == (0, 1, 2, 4, 8)
    engine = load(tmp_path / "l.nemo")
    assert engine.kind == "tdt" and engine.decoder.config.durations == (0, 1, 2, 4, 8)


@needs_shared
def test_a_tdt_loss_without_durations_is_refused(tmp_path):
    path = rebuilt(tmp_path / "m.nemo", config=lambda cfg: cfg["loss"]["tdt_kwargs"].pop("durations"))
    with pytest.raises(CheckpointError, match=rf"^{path}: config key 'loss\.tdt_kwargs\.durations' = None is not "
                                              r"supported: a TDT loss decodes with these durations"):
        load(path)


def tokenizer_model(pieces: int) -> bytes:
    import sentencepiece as spm

    model = io.BytesIO()
    text = ["and so my fellow americans ask not what your country can do for you",
            "ask what you can do for your country"] * 20
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=model, vocab_size=pieces,
                                   model_type="bpe", minloglevel=2)
    return model.getvalue()


@needs_shared
def test_a_tokenizer_that_does_not_fit_the_decoder_is_refused(tmp_path):
    """Another model's tokenizer loaded and spelt the text in the wrong vocabulary (exit 0);
    NeMo refuses it (the decoder it sizes from the tokenizer then fails to load)."""
    path = rebuilt(tmp_path / "swap.nemo", members={"tokenizer.model": tokenizer_model(40)})
    with pytest.raises(CheckpointError, match=rf"^{path}: the tokenizer has 40 pieces but decoder\.vocab_size = 128"):
        load(path)
    path = rebuilt(tmp_path / "ctc.nemo", HYBRID, config=lambda cfg: cfg["aux_ctc"]["decoder"].update(num_classes=127))
    with pytest.raises(CheckpointError, match=r"has 128 pieces but aux_ctc\.decoder\.num_classes = 127"):
        load(path)


@needs_shared
def test_a_character_ctc_model_is_refused_for_what_it_is(tmp_path):
    """It was refused as having "no CTC head"; it has one, with a character vocabulary."""
    path = rebuilt(tmp_path / "char.nemo", HYBRID,
                   config=lambda cfg: cfg.update(target="nemo.collections.asr.models.ctc_models.EncDecCTCModel"))
    with pytest.raises(CheckpointError, match=rf"^{path}: .*EncDecCTCModel' is a character-vocabulary CTC model: "
                                              r"not supported \(BPE CTC models only"):
        load(path)


@needs_shared
def test_the_config_is_checked_before_any_weight_is_read(tmp_path, monkeypatch):
    """A refused key in a 2.4 GB checkpoint was found after reading every weight (12-21 s)."""
    def no_weights(self):
        raise AssertionError("the weights were read before the config was checked")

    monkeypatch.setattr(NemoArchive, "state_dict", no_weights)
    path = rebuilt(tmp_path / "beam.nemo", config=setter("decoding", "strategy", "beam"))
    with pytest.raises(CheckpointError, match="decoding.strategy"):
        load(path)


@needs_shared
def test_a_model_in_a_folder_that_cannot_be_entered_is_one_line(tmp_path):
    """Path.exists raised PermissionError (a traceback) for a --model in a folder without x
    permission. Run without the capability that lets root in anyway."""
    locked = tmp_path / "locked"
    locked.mkdir()
    shutil.copy(TDT, locked / "m.nemo")
    locked.chmod(0)
    drop = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: cannot drop CAP_DAC_OVERRIDE")
        drop = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
                "--bounding-set=-dac_override,-dac_read_search"]
    try:
        probe = subprocess.run([*drop, sys.executable, "-c", f"import os; os.stat({str(locked / 'm.nemo')!r})"],
                               capture_output=True)
        if probe.returncode == 0:
            pytest.skip("the folder can be entered anyway (capabilities could not be dropped)")
        audio = str(SPEECH / "jfk" / "jfk.flac")
        for command in ([audio, "--out", str(tmp_path / "out")], ["stream", audio]):
            p = subprocess.run([*drop, sys.executable, "-m", "transcribe.cli", *command, "--model", str(locked / "m.nemo")],
                               capture_output=True, text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
            assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
            assert p.stderr.strip().splitlines()[-1].endswith(f"{locked / 'm.nemo'}: permission denied "
                                                              "(a folder on its path cannot be entered)"), p.stderr
    finally:
        locked.chmod(0o755)


def test_a_whisper_checkpoint_cut_short_names_the_folder(tmp_path):
    """The reader's own errors ("model.bin is truncated inside ...") named no file: a model from
    $TRANSCRIBE_MODEL or a snapshot path left the user guessing which."""
    from engines.whisper_weights import WhisperWeightsError, bundled_base_dir, load_any

    folder = tmp_path / "cut"
    folder.mkdir()
    with open(bundled_base_dir()[0][0], "rb") as whole:
        (folder / "model.bin").write_bytes(whole.read(3_000_000))
    with pytest.raises(WhisperWeightsError, match=rf"^{folder}: model\.bin is truncated inside '"):
        load_any(folder)
