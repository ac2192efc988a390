//! Real chat templates, copied from the models' `tokenizer_config.json`
//! (under chat_templates/), render to exactly what transformers renders.
//! The expected strings were checked against Python's Jinja with
//! transformers' settings by `scripts/chat-template-reference.py`, whose
//! cases these are.

use super::super::{ChatMessage, ChatOptions, ChatTemplate};
use serde_json::json;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tessera_core::Error;

const LLAMA3: &str = include_str!("chat_templates/llama-3-instruct.jinja");
const LLAMA32: &str = include_str!("chat_templates/llama-3.2-instruct.jinja");
const QWEN2: &str = include_str!("chat_templates/qwen2-chatml.jinja");
const QWEN25: &str = include_str!("chat_templates/qwen2.5-instruct.jinja");
const MISTRAL: &str = include_str!("chat_templates/mistral-instruct.jinja");
const ZEPHYR: &str = include_str!("chat_templates/zephyr.jinja");
const GEMMA: &str = include_str!("chat_templates/gemma.jinja");

/// 2025-01-15T09:30:00Z, the time `strftime_now` answers in these tests.
fn fixed_now() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_736_933_400)
}

/// `source` with the special tokens `(name, text)`, at the fixed time.
fn template(source: &str, special: &[(&str, &str)]) -> ChatTemplate {
    special.iter().fold(ChatTemplate::new(source).unwrap().with_fixed_time(fixed_now()), |t, (name, text)| t.with_special_token(*name, *text))
}

const LLAMA3_TOKENS: [(&str, &str); 2] = [("bos_token", "<|begin_of_text|>"), ("eos_token", "<|eot_id|>")];
const MISTRAL_TOKENS: [(&str, &str); 3] = [("bos_token", "<s>"), ("eos_token", "</s>"), ("unk_token", "<unk>")];
const GEMMA_TOKENS: [(&str, &str); 4] = [("bos_token", "<bos>"), ("eos_token", "<eos>"), ("unk_token", "<unk>"), ("pad_token", "<pad>")];
const QWEN_TOKENS: [(&str, &str); 2] = [("eos_token", "<|im_end|>"), ("pad_token", "<|endoftext|>")];

fn system_chat() -> Vec<ChatMessage> {
    vec![
        ChatMessage::system("You are a helpful assistant."),
        ChatMessage::user("Hello!"),
        ChatMessage::assistant("  Hi there.  "),
        ChatMessage::user("What is 2+2? héllo 😀"),
    ]
}

fn plain_chat() -> Vec<ChatMessage> {
    vec![ChatMessage::user("Hello!"), ChatMessage::assistant("Hi there."), ChatMessage::user("What is 2+2?")]
}

fn weather_tool() -> serde_json::Value {
    json!({
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        }
    })
}

fn tool_chat() -> Vec<ChatMessage> {
    let call = json!([{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}}]);
    vec![
        ChatMessage::system("You are a weather bot."),
        ChatMessage::user("Weather in Paris?"),
        ChatMessage { role: "assistant".into(), content: serde_json::Value::Null, extra: Default::default() }.with("tool_calls", call),
        ChatMessage::new("tool", "21 degrees"),
    ]
}

fn render(t: &ChatTemplate, messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    t.render(messages, &ChatOptions { add_generation_prompt, ..ChatOptions::default() }).unwrap()
}

/// The message of a render the template refused with `raise_exception`.
fn refusal(t: &ChatTemplate, messages: &[ChatMessage]) -> String {
    match t.render(messages, &ChatOptions::generation()) {
        Err(Error::InvalidArgument { op: "chat template", detail }) => detail,
        other => panic!("expected the template to refuse the messages, got {other:?}"),
    }
}

#[test]
fn llama_3_instruct() {
    let t = template(LLAMA3, &LLAMA3_TOKENS);
    assert_eq!(
        render(&t, &system_chat(), true),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2? héllo 😀<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    assert_eq!(
        render(&t, &plain_chat(), false),
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
    );
}

#[test]
fn chatml_as_qwen2() {
    let t = template(QWEN2, &QWEN_TOKENS);
    assert_eq!(
        render(&t, &system_chat(), true),
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n  Hi there.  <|im_end|>\n<|im_start|>user\nWhat is 2+2? héllo 😀<|im_end|>\n<|im_start|>assistant\n"
    );
    // Without a system message the template writes its default one.
    assert_eq!(
        render(&t, &plain_chat(), false),
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\nHi there.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    );
}

#[test]
fn mistral_instruct_and_its_role_alternation() {
    let t = template(MISTRAL, &MISTRAL_TOKENS);
    assert_eq!(render(&t, &plain_chat(), true), "<s>[INST] Hello! [/INST]Hi there.</s>[INST] What is 2+2? [/INST]");
    let alternate = "the model's chat template refuses these messages: Conversation roles must alternate user/assistant/user/assistant/...";
    assert_eq!(refusal(&t, &system_chat()), alternate);
    assert_eq!(refusal(&t, &[ChatMessage::user("a"), ChatMessage::user("b")]), alternate);
    // The typed error reads as a sentence that names the operation.
    let e = t.render(&[ChatMessage::assistant("a")], &ChatOptions::generation()).unwrap_err();
    assert_eq!(e.to_string(), format!("chat template: invalid argument: {alternate}"));
}

#[test]
fn zephyr_and_tinyllama_with_trim_blocks() {
    // The template puts a newline after every block tag; trim_blocks and
    // lstrip_blocks remove them, as transformers' environment does.
    let t = template(ZEPHYR, &MISTRAL_TOKENS);
    assert_eq!(
        render(&t, &system_chat(), true),
        "<|system|>\nYou are a helpful assistant.</s>\n<|user|>\nHello!</s>\n<|assistant|>\n  Hi there.  </s>\n<|user|>\nWhat is 2+2? héllo 😀</s>\n<|assistant|>\n"
    );
    assert_eq!(render(&t, &plain_chat(), false), "<|user|>\nHello!</s>\n<|assistant|>\nHi there.</s>\n<|user|>\nWhat is 2+2?</s>\n");
}

#[test]
fn gemma_refuses_a_system_role() {
    let t = template(GEMMA, &GEMMA_TOKENS);
    assert_eq!(
        render(&t, &plain_chat(), true),
        "<bos><start_of_turn>user\nHello!<end_of_turn>\n<start_of_turn>model\nHi there.<end_of_turn>\n<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    );
    assert_eq!(refusal(&t, &system_chat()), "the model's chat template refuses these messages: System role not supported");
}

#[test]
fn llama_3_2_writes_todays_date_and_tools() {
    let t = template(LLAMA32, &LLAMA3_TOKENS);
    assert_eq!(
        render(&t, &system_chat(), true),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 15 Jan 2025\n\nYou are a helpful assistant.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2? héllo 😀<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    // A template variable from the request overrides the clock.
    let mut options = ChatOptions::generation();
    options.kwargs.insert("date_string".into(), json!("01 Jan 2030"));
    assert_eq!(
        t.render(&plain_chat(), &options).unwrap(),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 01 Jan 2030\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    // Tools: `tojson(indent=4)` of the schema, the call's arguments as JSON,
    // and a string tool result through `tojson` (a string is iterable in Jinja).
    let options = ChatOptions { tools: Some(vec![weather_tool()]), ..ChatOptions::generation() };
    assert_eq!(
        t.render(&tool_chat(), &options).unwrap(),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 15 Jan 2025\n\nYou are a weather bot.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n{\n    \"function\": {\n        \"description\": \"The weather in a city\",\n        \"name\": \"get_weather\",\n        \"parameters\": {\n            \"properties\": {\n                \"city\": {\n                    \"type\": \"string\"\n                }\n            },\n            \"required\": [\n                \"city\"\n            ],\n            \"type\": \"object\"\n        }\n    },\n    \"type\": \"function\"\n}\n\nWeather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"unit\": \"°C\"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n\"21 degrees\"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
}

#[test]
fn qwen_2_5_with_and_without_tools() {
    let t = template(QWEN25, &QWEN_TOKENS);
    assert_eq!(
        render(&t, &plain_chat(), true),
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\nHi there.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    let options = ChatOptions { tools: Some(vec![weather_tool()]), ..ChatOptions::generation() };
    assert_eq!(
        t.render(&tool_chat(), &options).unwrap(),
        "<|im_start|>system\nYou are a weather bot.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"function\": {\"description\": \"The weather in a city\", \"name\": \"get_weather\", \"parameters\": {\"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"], \"type\": \"object\"}}, \"type\": \"function\"}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"°C\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n21 degrees\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn what_hf_templates_use_beyond_the_fixtures() {
    let t = |src: &str| ChatTemplate::new(src).unwrap().with_fixed_time(fixed_now());
    let msgs = [ChatMessage::system("  Be brief.  "), ChatMessage::user("a,b c"), ChatMessage::assistant("x").with("name", json!("bot"))];
    let cases = [
        // Python's string methods (minijinja-contrib's pycompat).
        ("{{ messages[0].content.strip() }}|{{ messages[1].content.split(',') }}|{{ messages[1].content.startswith('a') }}|{{ 'X'.lower() }}", "Be brief.|['a', 'b c']|True|x"),
        // Loop controls, loop variables, namespaces, slices and negative indices.
        (
            "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}{% if m.role == 'assistant' %}{% break %}{% endif %}{% endfor %}{{ ns.n }}{{ messages[1:]|length }}{{ messages[-1].role }}",
            "22assistant",
        ),
        // Keys present only when given; Python's None; the date.
        ("{{ 'name' in messages[2] }}{{ 'name' in messages[1] }}|{{ tools }}|{{ strftime_now('%Y-%m-%d %H:%M') }}", "TrueFalse|None|2025-01-15 09:30"),
        // Python dict methods and tojson of a message.
        ("{% for k, v in messages[2].items() %}{{ k }}={{ v }};{% endfor %}{{ messages[2] | tojson }}", "role=assistant;content=x;name=bot;{\"role\": \"assistant\", \"content\": \"x\", \"name\": \"bot\"}"),
        // transformers' `{% generation %}` blocks are rendered as plain output.
        ("{%- for m in messages -%}{%- generation -%}[{{ m.role }}]{%- endgeneration -%}{%- endfor -%}", "[system][user][assistant]"),
        // `add_generation_prompt` is always defined.
        ("{{ add_generation_prompt is defined }}{{ documents is none }}", "TrueTrue"),
    ];
    for (src, want) in cases {
        assert_eq!(t(src).render(&msgs, &ChatOptions::default()).unwrap(), want, "{src}");
    }
}

#[test]
fn template_failures_are_typed_errors() {
    // A syntax error is found at compile time and names the line.
    let e = ChatTemplate::new("{% for m in messages %}\n{{ m.content }\n{% endfor %}").unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { op: "chat template", .. }) && e.to_string().contains("line 2"), "{e}");
    // A failure while rendering that is not the template's own refusal.
    let e = ChatTemplate::new("{{ messages[0].content.nosuchmethod() }}").unwrap().render(&[ChatMessage::user("a")], &ChatOptions::default()).unwrap_err();
    assert!(matches!(e, Error::Unsupported { op: "chat template", .. }) && e.to_string().contains("line 1"), "{e}");
    // A template that does not end is stopped by its fuel.
    let e = ChatTemplate::new("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
        .unwrap()
        .render(&[], &ChatOptions::default())
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("steps"), "{e}");
    // The renderer's own variables cannot be overridden through kwargs.
    let mut options = ChatOptions::default();
    options.kwargs.insert("messages".into(), json!([]));
    let e = ChatTemplate::new("x").unwrap().render(&[], &options).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("`messages`"), "{e}");
}
