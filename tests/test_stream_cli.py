"""`transcribe stream` and `transcribe serve` as commands: usage errors, the offline decoder's
checks, and a server stopped by a signal closing its clients and exiting 128 + the signal."""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import NEMO_REF, SPEECH, needs_shared

MODEL = str(NEMO_REF / "rnnt_streaming_tiny" / "model.nemo")
pytestmark = needs_shared


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transcribe.cli", *args], capture_output=True, text=True,
                          timeout=300, **kw)


def test_option_values_that_cannot_work_are_usage_errors():
    audio = str(SPEECH / "jfk" / "jfk.flac")
    for args in (("stream", audio, "--model", MODEL, "--chunk-ms", "0"),
                 ("stream", audio, "--model", MODEL, "--left-context-ms", "-5"),
                 ("stream", audio, "--model", MODEL, "--chunk-ms", "inf"),
                 ("serve", "--model", MODEL, "--port", "70000"),
                 ("serve", "--model", MODEL, "--ws-port", "-1"),
                 ("serve", "--model", MODEL, "--idle-timeout", "0"),
                 ("serve", "--model", MODEL, "--device", "bogus"),
                 ("serve", "--model", MODEL, "--dtype", "bogus"),
                 ("serve", "--model", MODEL, "--log-level", "loud"),
                 ("serve", "--model", MODEL, "--encoder-backend", "tensorrt"),
                 # a window past MAX_WINDOW_MS: 1e12 walked every chunk position until the OOM
                 # killer came; 1e300 overflowed in torch ("error: Overflow ...", exit 1)
                 ("stream", audio, "--model", MODEL, "--left-context-ms", "1e12"),
                 ("stream", audio, "--model", MODEL, "--chunk-ms", "1e300"),
                 ("serve", "--model", MODEL, "--right-context-ms", "299000"),
                 ("serve", "--model", MODEL, "--port", "4567", "--ws-port", "4567"),  # was "address already in use"
                 ("serve", "--model", MODEL, "--host", "no-such-host.invalid"),  # was said after the model loaded
                 ("stream", "-", "--model", MODEL)):  # was "-: no such file"
        p = _cli(*args)
        assert p.returncode == 2 and "Traceback" not in p.stderr, (args, p.stderr)


def test_more_slots_than_memory_holds_is_a_message_not_a_traceback(monkeypatch):
    """The allocator's refusal (here its message stands in: a real one needs tens of GB asked
    for, and a machine that grants part of it can end in the OOM killer) becomes a ValueError
    that `serve` prints (exit 1) naming --max-streams; other errors pass through."""
    import pytest

    import transcribe.streaming.scheduler as scheduler
    from transcribe.streaming.scheduler import StreamingModel

    model = StreamingModel.from_nemo(MODEL)
    refused = "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to allocate"
    for error, raised in ((RuntimeError(refused), ValueError), (RuntimeError("shape mismatch"), RuntimeError)):
        def pool(*args, error=error):
            raise error
        monkeypatch.setattr(scheduler, "StreamPool", pool)
        with pytest.raises(raised) as e:
            model.new_pool(10**6)
        if raised is ValueError:
            assert "cannot allocate the cache pool for --max-streams 1000000 on cpu" in str(e.value)
            assert "give a smaller --max-streams" in str(e.value)


def test_chunking_options_a_model_does_not_take_are_usage_errors():
    """As --language for a Parakeet model: chunk options for a cache-aware checkpoint (it
    streams with its trained chunks), or a chunk shorter than the model's encoder frame, are
    the user's to change (exit 2), not "nothing could run" (exit 1)."""
    audio = str(SPEECH / "jfk" / "jfk.flac")
    chunked = str(NEMO_REF / "tdt_tiny" / "model.nemo")
    for args, says in ((("stream", audio, "--model", MODEL, "--chunk-ms", "500"), "cache-aware"),
                       (("stream", audio, "--model", chunked, "--chunk-ms", "10"), "at least one encoder frame"),
                       (("serve", "--model", MODEL, "--right-context-ms", "0", "--port", "0"), "cache-aware")):
        p = _cli(*args)
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)


def test_stream_says_its_chunking_before_the_transcript():
    """An offline-trained model streams in chunks with context: `stream` says which on stderr
    (an INFO line of ours, shown as a plain line; it was a warning), the transcript on stdout."""
    p = _cli("stream", str(SPEECH / "jfk" / "jfk.flac"), "--model", str(NEMO_REF / "tdt_tiny" / "model.nemo"))
    assert p.returncode == 0, p.stderr
    assert p.stderr.startswith("chunked streaming: chunk 2.00 s, left 10.00 s, right 2.00 s"), p.stderr
    assert "final]" in p.stdout and "chunked" not in p.stdout


def test_stream_reads_files_as_the_offline_command_does(tmp_path):
    """A WAV whose header promises more data than the file holds fails as offline fails it,
    rather than be streamed as the part that is there."""
    wav = (SPEECH / "alsa_channel_test" / "Front_Left.wav").read_bytes()
    (tmp_path / "trunc.wav").write_bytes(wav[:30000])
    p = _cli("stream", str(tmp_path / "trunc.wav"), "--model", MODEL)
    assert p.returncode == 1 and "truncated" in p.stderr, p.stderr
    # a missing file is said before the model loads (a minute for a big one): nothing about it
    p = _cli("stream", str(tmp_path / "none.wav"), "--model", str(NEMO_REF / "tdt_tiny" / "model.nemo"))
    assert p.returncode == 1 and "no such file" in p.stderr and "chunked streaming" not in p.stderr, p.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_signal_stops_the_server_cleanly_with_128_plus_it(sig):
    """^C, a closed terminal's SIGHUP, Slurm's SIGUSR1 (these two killed the server at once,
    its clients' connections reset with no word)."""
    server = subprocess.Popen([sys.executable, "-m", "transcribe.cli", "serve", "--model", MODEL, "--port", "0"],
                              stderr=subprocess.PIPE, text=True)
    try:
        line = server.stderr.readline()
        port = int(re.search(r" INFO listening on [^ ]+:(\d+)", line).group(1))  # not a WARNING line
        client = socket.create_connection(("127.0.0.1", port), timeout=30)
        pcm = (np.sin(np.arange(16000) / 9.0) * 8000).astype("<i2").tobytes()
        import base64
        client.sendall((json.dumps({"type": "hello", "stream_id": "a", "sample_rate": 16000, "format": "pcm16"})
                        + "\n" + json.dumps({"type": "audio", "data": base64.b64encode(pcm).decode()}) + "\n").encode())
        reader = client.makefile("r")
        assert json.loads(reader.readline())["type"] == "ready"
        time.sleep(0.5)
        server.send_signal(sig)
        _, err = server.communicate(timeout=60)
        assert server.returncode == 128 + sig and "Traceback" not in err and "Error" not in err, err
        rest = [json.loads(line) for line in reader.read().splitlines()]  # closed, not left hanging
        assert all(m["type"] in ("segment", "partial") for m in rest[:-1])
        assert rest[-1]["type"] == "error" and rest[-1]["code"] == "shutdown", rest  # told why
        client.close()
    finally:
        server.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_to_the_whole_process_group_is_a_clean_stop_and_leaves_no_process(sig):
    """systemd's stop (and a terminal's ^C or hang-up) signal every process of the group, the
    engine process (engine_process.py) too, here while steps run back to back: the stop is the
    clean one (128 + the signal, the client told "shutdown"), not an engine failure (1), and no
    process of the group outlives the server."""
    import base64
    import os

    server = subprocess.Popen([sys.executable, "-m", "transcribe.cli", "serve", "--model", MODEL, "--port", "0"],
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        port = int(re.search(r" INFO listening on [^ ]+:(\d+)", server.stderr.readline()).group(1))
        client = socket.create_connection(("127.0.0.1", port), timeout=30)
        pcm = (np.sin(np.arange(16000 * 20) / 9.0) * 8000).astype("<i2").tobytes()
        audio = json.dumps({"type": "audio", "data": base64.b64encode(pcm).decode()}) + "\n"
        client.sendall((json.dumps({"type": "hello", "stream_id": "a", "sample_rate": 16000, "format": "pcm16"})
                        + "\n" + audio * 5).encode())  # 100 s at once: steps run back to back for a while
        reader = client.makefile("r")
        assert json.loads(reader.readline())["type"] == "ready"
        assert json.loads(reader.readline())["type"] in ("segment", "partial")  # a step has run
        os.killpg(server.pid, sig)
        _, err = server.communicate(timeout=60)
        assert server.returncode == 128 + sig and "Traceback" not in err and "engine" not in err.lower(), err
        rest = [json.loads(line) for line in reader.read().splitlines()]
        assert rest[-1]["type"] == "error" and rest[-1]["code"] == "shutdown", rest
        client.close()
        left = []
        for _ in range(50):  # the engine process exits once the server has closed its pipe
            left = [d for d in os.listdir("/proc") if d.isdigit() and _pgid(int(d)) == server.pid]
            if not left:
                break
            time.sleep(0.1)
        assert not left, left
    finally:
        server.kill()


def _pgid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[2])
    except (OSError, ValueError, IndexError):
        return None


def test_a_server_started_with_sigint_ignored_keeps_ignoring_it():
    """`serve ... &` from a script starts with SIGINT ignored: a ^C meant for the shell must not
    stop it. SIGTERM still does (143)."""
    server = subprocess.Popen([sys.executable, "-m", "transcribe.cli", "serve", "--model", MODEL, "--port", "0"],
                              stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert " INFO listening on " in server.stderr.readline()  # the handlers are set up before it
        server.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):
            server.wait(timeout=2.0)
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=60)
        assert server.returncode == 143 and "Traceback" not in err, err
    finally:
        server.kill()


def test_stream_prints_segments_partials_and_the_final_as_the_server_sends_them():
    """`transcribe stream --json`: the server's messages (no stream id), in order; the summary's
    text is the final's, and the segments and the last partial joined make it up."""
    from transcribe.streaming.cli_commands import stream_file
    from transcribe.streaming.transcript import join_texts

    lines: list[str] = []
    audio = SPEECH / "longform" / "librispeech_test-other_1688-142285_concat.flac"
    summary = stream_file(audio, str(NEMO_REF / "tdt_tiny" / "model.nemo"), as_json=True, echo=lines.append,
                          chunk_ms=2000, left_ms=4000, right_ms=500)
    msgs = [json.loads(line) for line in lines]
    assert all("stream_id" not in m for m in msgs)
    assert [m["type"] for m in msgs][-1] == "final" and msgs[-1]["text"] == summary["text"]
    segments = [m for m in msgs if m["type"] == "segment"]
    last_partial = [m for m in msgs if m["type"] == "partial"][-1]
    assert len(segments) >= 3 and last_partial["index"] == len(segments) and msgs[-2] is last_partial
    # Whichever a client reads, the segments and the last partial, or the final, it ends the same.
    assert join_texts([m["text"] for m in segments] + [last_partial["text"]]) == summary["text"]
    assert [w for m in segments + [last_partial] for w in m["words"]] == msgs[-1]["words"]
    text_lines: list[str] = []
    stream_file(audio, str(NEMO_REF / "tdt_tiny" / "model.nemo"), echo=text_lines.append,
                chunk_ms=2000, left_ms=4000, right_ms=500)
    assert [line.split("] ", 1)[0].split()[-1] for line in text_lines] == [m["type"] for m in msgs]


def test_realtime_streaming_takes_as_long_as_the_audio_and_no_longer():
    """--realtime feeds each piece once its audio would have been recorded; the last, shorter
    piece as soon as its own audio is (it waited a whole piece: 5.4 s took 7.2 s in 7 s pieces)."""
    from transcribe.streaming.cli_commands import stream_file

    audio = SPEECH / "jfk" / "jfk.flac"  # 11.0 s: a 4 s piece, then 4 s, then 3 s
    summary = stream_file(audio, MODEL, realtime=True, piece_ms=4000, echo=lambda line: None)
    assert summary["audio_seconds"] - 0.05 <= summary["wall_seconds"] < summary["audio_seconds"] + 0.8, summary


def test_a_stdout_that_takes_nothing_is_named_as_such():
    """A full disk or a closed pipe on standard output was "error: [Errno 28] No space left
    on device", as if the audio file were at fault."""
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "transcribe.cli", "stream", str(SPEECH / "jfk" / "jfk.flac"),
                            "--model", MODEL], stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert p.returncode == 1 and p.stderr.endswith(
        "error: cannot write the transcript to standard output: No space left on device\n"), p.stderr


def test_pieces_of_a_decoders_blocks_are_the_files_samples_cut_evenly():
    """`stream` reads the file as it feeds it: the pieces are those of the whole file cut at
    every `size` samples, whatever blocks the decoder hands out."""
    from transcribe.streaming.cli_commands import _pieces

    rng = np.random.default_rng(0)
    audio = rng.standard_normal(10_007).astype(np.float32)
    for size in (1, 160, 1600, 10_007, 20_000):
        cuts = np.sort(rng.choice(np.arange(1, len(audio)), size=6, replace=False))
        got = list(_pieces(iter(np.split(audio, cuts)), size))
        want = [audio[i:i + size] for i in range(0, len(audio), size)]
        assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want)), size


def test_steps_count_pool_steps_not_a_final_that_came_alone():
    """With 10 ms pieces the last chunk is stepped before the stream ends, and the final comes
    in a call of its own: that call ran no step, and the summary said 5 steps where 4 ran."""
    from transcribe.streaming.cli_commands import stream_file

    audio = SPEECH / "librispeech_test_other" / "1688" / "1688-142285-0004.flac"
    steps = {ms: stream_file(audio, MODEL, piece_ms=ms, echo=lambda line: None)["steps"] for ms in (10, 100)}
    assert steps == {10: 4, 100: 4}, steps


def test_a_file_shorter_than_one_window_streams_to_an_empty_final(tmp_path):
    """Offline transcribes such a file now (as NeMo does), so `stream` reads it too: an empty
    final, as `serve` gives such a stream; its summary ran no step, and said so, not a
    traceback formatting a missing step time."""
    import soundfile as sf

    path = tmp_path / "blip.wav"
    sf.write(path, np.zeros(10, np.float32), 16000)
    p = _cli("stream", str(path), "--model", MODEL, "--json")
    assert p.returncode == 0, p.stderr
    final = [json.loads(line) for line in p.stdout.splitlines() if '"final"' in line]
    assert len(final) == 1 and final[0]["text"] == ""
    assert "0 steps" in p.stderr and "Traceback" not in p.stderr
