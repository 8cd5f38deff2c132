"""Hugging Face repo names for ``--model`` (``hub_names``) and which files of a repo they pick
(``hub_repo.select``, ``gguf_quants``): table tests of the pure parts."""

from __future__ import annotations

import pytest

from shoal.models.catalog import QuantFile
from shoal.models.errors import HubError, ModelError
from shoal.models.gguf_names import RepoFile
from shoal.models.hub_names import HubName, parse_hub_name
from shoal.models.hub_repo import gguf_quants, select

R = "bartowski/Qwen2.5-7B-Instruct-GGUF"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Catalog ids and paths are not repos.
        ("qwen2.5-7b-instruct", None),
        ("smollm2-135m-instruct", None),
        ("model.gguf", None),
        ("models/qwen.gguf", None),
        ("/models/org/repo", None),
        ("./org/repo", None),
        ("~/org/repo", None),
        ("a/b/c", None),
        # A repo: the fit chooses.
        (R, HubName(R, text=R)),
        (f"{R}:latest", HubName(R, text=f"{R}:latest")),
        # A quantization, any case.
        (f"{R}:Q4_K_M", HubName(R, "Q4_K_M", text=f"{R}:Q4_K_M")),
        (f"{R}:q8_0", HubName(R, "Q8_0", text=f"{R}:q8_0")),
        ("org/m:iq2_xxs", HubName("org/m", "IQ2_XXS", text="org/m:iq2_xxs")),
        # A file, split parts and folders included.
        ("org/m:m-Q4_K_M.gguf", HubName("org/m", file="m-Q4_K_M.gguf", text="org/m:m-Q4_K_M.gguf")),
        (
            "org/m:Q8_0/m-00001-of-00002.gguf",
            HubName(
                "org/m", file="Q8_0/m-00001-of-00002.gguf", text="org/m:Q8_0/m-00001-of-00002.gguf"
            ),
        ),
        # Ollama's and the web's prefixes.
        (f"hf.co/{R}:Q4_K_M", HubName(R, "Q4_K_M", text=f"{R}:Q4_K_M")),
        (f"HF.co/{R}", HubName(R, text=R)),
        (f"huggingface.co/{R}", HubName(R, text=R)),
        (f"https://huggingface.co/{R}:q5_k_m", HubName(R, "Q5_K_M", text=f"{R}:q5_k_m")),
        ("hf.co/org/m:m.gguf", HubName("org/m", file="m.gguf", text="org/m:m.gguf")),
    ],
)
def test_parse_hub_name(text: str, expected: HubName | None) -> None:
    assert parse_hub_name(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("hf.co/justaname", "does not name a Hugging Face repo"),
        ("hf.co/org/repo/file.gguf", "does not name a Hugging Face repo"),
        ("hf.co/org--x/repo", "does not name a Hugging Face repo"),
        ("org/repo:", "names no quantization or file"),
        ("org/repo:Q4 K", "is not a quantization name"),
    ],
)
def test_bad_hub_names_say_which_forms_work(text: str, message: str) -> None:
    with pytest.raises(ModelError, match=message) as failed:
        parse_hub_name(text)
    assert "org/repo:QUANT" in str(failed.value)


def test_the_id_clients_send_is_the_name_without_its_prefix() -> None:
    assert parse_hub_name(f"hf.co/{R}:Q4_K_M") == HubName(R, "Q4_K_M", text=f"{R}:Q4_K_M")
    assert HubName(R, "Q4_K_M", text=f"{R}:Q4_K_M").id == f"{R}:Q4_K_M"
    assert HubName(R).id == R


# --- which files of a repo ---

SHA = "a" * 64
FILES = [
    RepoFile("README.md", 10),
    RepoFile("m-Q4_K_M.gguf", 4000, SHA),
    RepoFile("m-Q8_0.gguf", 8000, SHA),
    RepoFile("F16/m-F16-00001-of-00002.gguf", 9000, SHA),
    RepoFile("F16/m-F16-00002-of-00002.gguf", 7000, SHA),
    RepoFile("mmproj-m-F16.gguf", 500, SHA),
]
QUANTS = gguf_quants("org/m", FILES)


def test_gguf_quants_group_split_parts_and_leave_projectors_out() -> None:
    assert [(q.quantization, q.files, q.size_bytes) for q in QUANTS] == [
        ("Q4_K_M", ("m-Q4_K_M.gguf",), 4000),
        ("Q8_0", ("m-Q8_0.gguf",), 8000),
        ("F16", ("F16/m-F16-00001-of-00002.gguf", "F16/m-F16-00002-of-00002.gguf"), 16000),
    ]


@pytest.mark.parametrize(
    ("name", "requested", "files"),
    [
        (HubName("org/m"), None, None),  # the fit chooses
        (HubName("org/m", "Q8_0"), None, ("m-Q8_0.gguf",)),
        (HubName("org/m"), "q4_k_m", ("m-Q4_K_M.gguf",)),
        (HubName("org/m", "Q4_K_M"), "Q4_K_M", ("m-Q4_K_M.gguf",)),
        (
            HubName("org/m", "F16"),
            None,
            ("F16/m-F16-00001-of-00002.gguf", "F16/m-F16-00002-of-00002.gguf"),
        ),
        (HubName("org/m", file="m-q8_0.gguf"), None, ("m-Q8_0.gguf",)),
        (
            HubName("org/m", file="F16/m-F16-00001-of-00002.gguf"),
            None,
            ("F16/m-F16-00001-of-00002.gguf", "F16/m-F16-00002-of-00002.gguf"),
        ),
    ],
)
def test_select(name: HubName, requested: str | None, files: tuple[str, ...] | None) -> None:
    chosen = select(name, FILES, QUANTS, requested)
    assert (chosen.files if chosen is not None else None) == files


def test_a_named_file_is_one_quantization_with_its_own_size_and_hashes() -> None:
    chosen = select(HubName("org/m", file="F16/m-F16-00002-of-00002.gguf"), FILES, QUANTS)
    assert chosen == QuantFile(
        "F16",
        ("F16/m-F16-00001-of-00002.gguf", "F16/m-F16-00002-of-00002.gguf"),
        16000,
        size_exact=True,
        sha256=(SHA, SHA),
    )


@pytest.mark.parametrize(
    ("name", "requested", "message"),
    [
        (
            HubName("org/m", "Q5_K_M"),
            None,
            r"org/m has no Q5_K_M quantization; it has Q4_K_M, Q8_0, F16\.",
        ),
        (HubName("org/m"), "IQ2_XS", r"no IQ2_XS quantization; it has Q4_K_M, Q8_0, F16"),
        (
            HubName("org/m", "Q8_0"),
            "Q4_K_M",
            "names quantization Q8_0 and --quantization says Q4_K_M",
        ),
        (HubName("org/m", file="m-Q8_0.gguf"), "Q8_0", "names a file; leave out --quantization"),
        (
            HubName("org/m", file="nope.gguf"),
            None,
            r"has no file nope.gguf; its GGUF files: m-Q4_K_M.gguf",
        ),
    ],
)
def test_select_refuses_what_the_repo_lacks(
    name: HubName, requested: str | None, message: str
) -> None:
    with pytest.raises(ModelError, match=message):
        select(name, FILES, QUANTS, requested)


def test_a_split_file_with_a_missing_part_is_refused() -> None:
    files = [f for f in FILES if not f.path.endswith("00002-of-00002.gguf")]
    with pytest.raises(ModelError, match=r"lacks F16/m-F16-00002-of-00002.gguf"):
        select(HubName("org/m", file="F16/m-F16-00001-of-00002.gguf"), files, QUANTS)


def test_a_repo_without_gguf_files_says_what_it_holds() -> None:
    files = [
        RepoFile("config.json", 1),
        RepoFile("model.safetensors", 2),
        RepoFile("mmproj-F16.gguf", 3),
    ]
    with pytest.raises(
        HubError,
        match=r"org/m has no GGUF model \(it holds config.json, model.safetensors, mmproj-F16",
    ):
        gguf_quants("org/m", files)
    many = [RepoFile(f"f{i}.bin", 1) for i in range(12)]
    with pytest.raises(HubError, match=r"f7.bin and 4 more\)"):
        gguf_quants("org/m", many)
