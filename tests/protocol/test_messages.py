from __future__ import annotations

import pytest
from pydantic import ValidationError

from shoal.protocol.ids import JobId, ModelName, WorkerId
from shoal.protocol.messages import (
    Chunk,
    Chunks,
    Endpoint,
    HeartbeatInterval,
    JobDone,
    JobStart,
    LinkRtt,
    ModelFile,
    ShardLinks,
    ShardRole,
    ShardStart,
    decode_chunk_items,
    decode_router_message,
    decode_worker_message,
    encode,
    encode_chunks,
)


def test_round_trip_and_frozen() -> None:
    start = JobStart(
        job_id=JobId("j"),
        model=ModelName("m"),
        endpoint=Endpoint.CHAT,
        stream=True,
        body={"messages": [{"role": "user", "content": "hi"}]},
    )
    assert decode_router_message(encode(start)) == start
    with pytest.raises(ValidationError):
        start.stream = False  # type: ignore[misc]
    chunks = Chunks(items=(Chunk(job_id=JobId("j"), data='{"x": "\\n"}'),))
    assert decode_worker_message(encode(chunks)) == chunks


@pytest.mark.parametrize(
    "frame",
    [
        "not json",
        '{"type": "nope"}',
        '{"type": "done"}',  # missing job_id
        '{"type": "done", "job_id": "j", "extra": 1}',  # extra fields are refused
        '{"type": "job", "job_id": "j", "model": "m", "endpoint": "chat", "stream": true,'
        ' "body": {}}',  # a router message is not a worker message
    ],
)
def test_malformed_worker_frames_are_rejected(frame: str) -> None:
    with pytest.raises(ValidationError):
        decode_worker_message(frame)


def test_unknown_endpoint_is_rejected() -> None:
    with pytest.raises(ValidationError):
        decode_router_message(
            '{"type": "job", "job_id": "j", "model": "m", '
            '"endpoint": "bogus", "stream": true, "body": {}}'
        )


def test_fast_chunk_encoding_is_the_chunks_message() -> None:
    items = [
        (JobId("job_1"), '{"a": "é\\n\\"q\\""}', None),
        (JobId("job_2"), "[DONE]", None),
        (JobId("job_3"), "x", (5, 7)),
    ]
    fast = encode_chunks(items)
    slow = encode(
        Chunks(
            items=tuple(
                Chunk(job_id=j, data=d) if t is None else Chunk(job_id=j, data=d, tokens=t)
                for j, d, t in items
            )
        )
    )
    assert fast == slow.replace(',"tokens":null', "").encode()
    assert decode_worker_message(fast) == Chunks(
        items=tuple(Chunk(job_id=j, data=d, tokens=t) for j, d, t in items)
    )


def test_fast_chunk_decoding_matches_the_model() -> None:
    items = [(JobId("job_1"), '{"a": "é\\n"}', None), (JobId("job_2"), "x", (1, 2, 3))]
    frame = encode_chunks(items)
    assert decode_chunk_items(frame) == items
    assert decode_chunk_items(frame.decode()) == items
    assert decode_chunk_items(encode(JobDone(job_id=JobId("j")))) is None


@pytest.mark.parametrize(
    "frame",
    [
        b'{"type":"chunks","items":[{"job_id":"j","data":1}]}',
        b'{"type":"chunks","items":[{"job_id":"j","data":"x","more":1}]}',
        b'{"type":"chunks","items":[["j","x"]]}',
        b'{"type":"chunks","items":[],"extra":true}',
        b'{"type":"chunks","items":[{"job_id":"j","data":"x","tokens":["a"]}]}',
        b'{"type":"chunks","items":[{"job_id":"j"',
    ],
)
def test_fast_chunk_decoding_rejects_what_the_model_rejects(frame: bytes) -> None:
    with pytest.raises(ValueError):
        decode_chunk_items(frame)
    with pytest.raises(ValidationError):
        decode_worker_message(frame)


def test_hardware_models_and_memory_messages_round_trip() -> None:
    from shoal.protocol.ids import WorkerId
    from shoal.protocol.messages import (
        BackendState,
        GpuInfo,
        Hardware,
        Heartbeat,
        ModelInfo,
        ModelsChanged,
        Registered,
    )

    gpu = GpuInfo(index=1, name="NVIDIA A10", accelerator="cuda", memory_total_bytes=24 << 30)
    hw = Hardware(
        hostname="h",
        os="Linux",
        cpu_count=8,
        ram_total_bytes=1,
        ram_available_bytes=1,
        accelerator="cuda",
        gpus=(gpu,),
    )
    assert Hardware.model_validate_json(hw.model_dump_json()) == hw
    beat = Heartbeat(
        state=BackendState.UNLOADED, running_jobs=0, ram_available_bytes=5, gpu_free_bytes=(7, None)
    )
    models = ModelsChanged(models=(ModelInfo(name=ModelName("m"), endpoints=(Endpoint.CHAT,)),))
    for msg in (beat, models):
        assert decode_worker_message(encode(msg)) == msg
    reg = Registered(
        worker_id=WorkerId("w"), heartbeat_interval_s=1, router_version="x", default_model="m"
    )
    assert decode_router_message(encode(reg)) == reg


def test_a_heartbeat_carries_each_gpus_telemetry() -> None:
    from shoal.protocol.messages import PROTOCOL_VERSION, BackendState, GpuSample, Heartbeat

    busy = GpuSample(
        index=0,
        uuid="GPU-1",
        name="NVIDIA H100 80GB HBM3",
        utilization_percent=37.0,
        memory_used_bytes=72790 << 20,
        memory_total_bytes=81559 << 20,
        temperature_celsius=39.0,
        power_watts=145.2,
        power_limit_watts=700.0,
    )
    unknown = GpuSample(index=1)  # a GPU whose tool said nothing but that it is there
    beat = Heartbeat(
        state=BackendState.READY,
        running_jobs=1,
        ram_available_bytes=5,
        gpu_free_bytes=(8769 << 20, None),
        gpu_telemetry=(busy, unknown),
    )
    assert decode_worker_message(encode(beat)) == beat
    assert busy.memory_free_bytes == 8769 << 20 and unknown.memory_free_bytes is None
    # A v7 router forbids the new field, so the version says it: it refuses v8 workers.
    assert PROTOCOL_VERSION >= 8
    with pytest.raises(ValidationError):
        decode_worker_message(
            '{"type": "heartbeat", "state": "ready", "running_jobs": 0,'
            ' "ram_available_bytes": 1, "gpu_telemetry": [{"index": 0, "fan_percent": 30}]}'
        )


def test_a_shard_start_carries_the_pinned_file() -> None:
    pinned = ModelFile(
        source="m",
        kind="hub",
        quantization="Q4_K_M",
        repo="org/m-GGUF",
        filename="m-Q4_K_M.gguf",
        revision="0" * 40,
        sha256="a" * 64,
        size=10,
    )
    start = ShardStart(
        deployment="d",
        role=ShardRole.STAGE,
        model=ModelName("d"),
        source="m",
        ctx_size=512,
        layers=(1, 2),
        file=pinned,
    )
    assert decode_router_message(encode(start)) == start
    unpinned = start.model_copy(update={"file": None})
    assert decode_router_message(encode(unpinned)) == unpinned
    with pytest.raises(ValidationError):
        decode_router_message(encode(start).replace('"kind":"hub"', '"kind":"ftp"'))


def test_a_heartbeat_interval_round_trips_and_must_be_positive() -> None:
    pace = HeartbeatInterval(seconds=40.0)
    assert decode_router_message(encode(pace)) == pace
    with pytest.raises(ValidationError):
        decode_router_message('{"type": "heartbeat_interval", "seconds": 0}')
    with pytest.raises(ValidationError):
        decode_router_message('{"type": "heartbeat_interval", "seconds": 5, "extra": 1}')


def test_a_heads_link_report_sums_up_turnarounds_and_round_trips() -> None:
    ns = [3_000_000, 1_000_000, 2_000_000, 10_000_000] + [2_500_000] * 6
    rtt = LinkRtt.of(WorkerId("b"), ns)
    assert rtt is not None
    assert (rtt.median_ms, rtt.p90_ms, rtt.samples) == (2.5, 10.0, 10)
    assert LinkRtt.of(WorkerId("b"), []) is None  # nothing answered yet: no figure
    one = LinkRtt.of(WorkerId("c"), [1_234_567])
    assert one is not None and (one.median_ms, one.p90_ms, one.samples) == (1.235, 1.235, 1)
    report = ShardLinks(deployment="split", stages=(rtt, one))
    assert decode_worker_message(encode(report)) == report
    with pytest.raises(ValidationError):  # a figure always has a sample behind it
        decode_worker_message(
            '{"type": "shard_links", "deployment": "split", "stages": [{"worker_id": "b", '
            '"median_ms": 1, "p90_ms": 1, "samples": 0}]}'
        )
