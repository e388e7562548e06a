"""`POST /v1/embeddings` through the official client: inputs of every shape, float and
base64 answers, transformers' pooled hidden states, and the 400s."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from served import LiveServer


def reference(folder: Path, prompt: list[int], pooling: str) -> np.ndarray:
    import transformers

    model = transformers.AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    pooled = hidden[-1] if pooling == "last" else hidden.mean(0)
    return (pooled / pooled.norm()).numpy()


def test_every_input_shape_and_both_encodings(live: LiveServer, tiny_chat_model: Path) -> None:
    client = live.client()
    tokenizer = live.engine.tokenizer
    assert tokenizer is not None
    ids = tokenizer.encode("The cat sat on the mat.")
    # The official client asks for base64 unless told, and decodes it to floats.
    as_text = client.embeddings.create(model="tiny", input="The cat sat on the mat.")
    as_floats = client.embeddings.create(
        model="tiny", input="The cat sat on the mat.", encoding_format="float"
    )
    as_ids = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    many = client.embeddings.create(
        model="tiny", input=[ids, ids[:3]], extra_body={"pooling": "mean"}
    )
    assert as_text.data[0].embedding == pytest.approx(as_floats.data[0].embedding, abs=1e-7)
    assert as_ids.data[0].embedding == as_floats.data[0].embedding
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == len(ids)
    assert [item.index for item in many.data] == [0, 1] and many.model == "tiny"
    hidden = live.engine.geometry.hidden_size
    assert len(as_floats.data[0].embedding) == hidden
    np.testing.assert_allclose(
        as_floats.data[0].embedding, reference(tiny_chat_model, ids, "last"), atol=1e-4
    )
    np.testing.assert_allclose(
        many.data[1].embedding, reference(tiny_chat_model, ids[:3], "mean"), atol=1e-4
    )
    strings = client.embeddings.create(model="tiny", input=["a b", "c"], encoding_format="float")
    assert len(strings.data) == 2


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": ""}, "input", "at least 1 character"),
        ({"input": []}, "input", "at least 1 item"),
        ({"input": [[1, 2], []]}, "input.1", "at least 1 item"),
        ({"input": [10**7]}, "input", "outside the vocabulary"),
        ({"input": [1] * 400}, "input", "above the 255 an embedding input holds"),
        ({"input": "x", "dimensions": 7}, "dimensions", "not trained to shorten"),
        ({"input": "x", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "float"),
        ({"input": "x", "pooling": "max"}, "pooling", "last"),
    ],
)
def test_bad_requests_are_400s_naming_the_parameter(
    live: LiveServer, body: dict[str, object], param: str, says: str
) -> None:
    client = live.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/embeddings", body=body, cast_to=object)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == param and says in error["message"], error


def test_a_model_that_is_not_served_is_a_404(live: LiveServer) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        live.client().embeddings.create(model="gpt-4", input="x")
