"""Tool and response schemas as clients write them: pydantic models with nested models (`$defs`
and `$ref`s), `definitions` and a `$ref` to the schema's own root, two tools whose `$defs`
share a name, `anyOf` / nullable fields, `additionalProperties: false` and `strict: true`, all
through the official `openai` client against a live `tandem serve` on the default model
(SmolLM2-135M-Instruct). The schema pass itself (engine/prompts/structured.py) is tested without a
model first."""

from __future__ import annotations

import re

import openai
import pytest
from pydantic import BaseModel, Field

from engine.llama.grammar import schema_grammar
from engine.prompts.structured import standalone_schema
from engine.prompts.tool_calls import ToolMode, reply_grammar

SPEC = "cpu:threads=1,cap=4,ctx=2048"
TIMEOUT = 600  # seconds for one reply: a loaded two-core machine decodes a few tokens a second


class Address(BaseModel):
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)


class Person(BaseModel):
    name: str = Field(max_length=24)
    home: Address


class Item(BaseModel):
    sku: str = Field(max_length=12)
    quantity: int


class Order(BaseModel):
    customer: Person
    items: list[Item] = Field(max_length=3)


class Shipment(BaseModel):  # its own `Address`, of another shape than Person's
    class Address(BaseModel):
        street: str = Field(max_length=24)
        number: int

    to: Address
    note: str | None = Field(default=None, max_length=24)


def params(model: type[BaseModel]) -> dict:
    return model.model_json_schema()


# ---- the schema pass, without a model ----


def test_a_functions_defs_move_to_its_schemas_top_level_under_its_name():
    schema = standalone_schema(params(Person), "save")
    assert schema["properties"]["home"] == {"$ref": "#/$defs/defs-save-Address"}
    assert schema["$defs"]["defs-save-Address"]["properties"].keys() == {"city", "country"}


def test_two_tools_defs_of_one_name_stay_apart_in_one_grammar():
    grammars = {name: schema_grammar(standalone_schema(model.model_json_schema(), name), param="tools")
                for name, model in (("save", Person), ("ship", Shipment))}
    grammar = reply_grammar(ToolMode("auto", ("save", "ship")), grammars)
    assert "tandem-f0-defs-save-Address" in grammar and "tandem-f1-defs-ship-Address" in grammar
    assert grammar.count("\nroot ::=") == 1  # each function's own root renamed apart


def test_definitions_with_a_ref_to_the_root_are_lifted():
    tree = {"type": "object", "properties": {"label": {"type": "string"},
                                             "children": {"type": "array", "items": {"$ref": "#"}},
                                             "tag": {"$ref": "#/definitions/Tag"}},
            "definitions": {"Tag": {"type": "string", "enum": ["a", "b"]}}}
    out = standalone_schema(tree, "tree")
    for body in (out, out["$defs"]["defs-tree"]):  # the root, and its copy that `#` now points at
        assert body["properties"]["children"]["items"] == {"$ref": "#/$defs/defs-tree"}
        assert body["properties"]["tag"] == {"$ref": "#/$defs/defs-tree-Tag"}
    assert "definitions" not in out
    schema_grammar(out)  # the converter resolves every reference


def test_a_nullable_field_gets_a_null_branch():
    out = standalone_schema({"type": "object", "properties": {"x": {"type": "string", "nullable": True}}})
    assert out["properties"]["x"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}


def test_values_that_look_like_refs_are_left_alone():
    schema = {"type": "object", "properties": {"$ref": {"type": "string", "default": "#/nowhere",
                                                        "const": {"$ref": "#/x"}}}}
    assert standalone_schema(schema) == schema


def test_a_schema_without_definitions_is_unchanged():
    assert standalone_schema(params(Item)) == params(Item)


# ---- through the API ----



def test_a_pydantic_function_tool_of_a_nested_model_gives_a_valid_call(client):
    tool = openai.pydantic_function_tool(Order, name="place_order", description="Place an order")
    r = client.chat.completions.parse(
        model="default", temperature=0, tools=[tool], tool_choice="required", max_tokens=300,
        messages=[{"role": "user", "content": "Order two apples for Ann, who lives in Oslo, Norway."}])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "place_order"
    assert isinstance(call.function.parsed_arguments, Order)


@pytest.mark.parametrize("name,model", [("save_person", Person), ("ship", Shipment)])
def test_two_tools_with_defs_of_one_name_each_get_valid_calls(client, name, model):
    tools = [openai.pydantic_function_tool(Person, name="save_person"),
             openai.pydantic_function_tool(Shipment, name="ship")]
    r = client.chat.completions.create(
        model="default", temperature=0, tools=tools, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": name}},
        messages=[{"role": "user", "content": "Ann lives at 3 Main Street in Oslo, Norway."}])
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == name
    model.model_validate_json(call.function.arguments)  # raises if they do not validate


def test_a_nested_response_format_with_a_nullable_field_parses(client):
    r = client.chat.completions.parse(
        model="default", temperature=0, response_format=Shipment, max_tokens=200,
        messages=[{"role": "user", "content": "Ship a parcel to 3 Main Street."}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Shipment)


def test_a_response_format_with_a_ref_to_its_root_is_accepted(client):
    """Was a 400 ("Unsupported ref #"); the reply is decoded under the recursive grammar (a
    135M model may nest until `max_tokens`, so only its start is checked)."""
    tree = {"type": "object", "additionalProperties": False, "required": ["label", "children"],
            "properties": {"label": {"type": "string", "maxLength": 12},
                           "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}}}
    r = client.chat.completions.create(
        model="default", temperature=0, max_tokens=24,
        response_format={"type": "json_schema", "json_schema": {"name": "tree", "schema": tree, "strict": True}},
        messages=[{"role": "user", "content": "A tree with one node labelled root and no children."}])
    content = r.choices[0].message.content
    assert re.match(r'^\{\s*"label"\s*:\s*"', content), content
