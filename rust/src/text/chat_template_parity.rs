//! Chat templates rendered by transformers 5.24 (`apply_chat_template(..., tokenize=False)`,
//! jinja2 3.1) and the strings it gave, kept as literals so the test needs no Python.

use serde_json::{Map, Value};

use super::chat_template::ChatTemplate;

pub const CHATML: &str = r#"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

pub const LLAMA3: &str = r#"{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>

'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>

' }}{% endif %}"#;

pub const PYISMS: &str = r#"{% set ns = namespace(n=0, sys=none) %}
{% for m in messages %}
    {% if m.role == 'system' %}
        {% set ns.sys = m.content %}
        {% continue %}
    {% endif %}
    {% set ns.n = ns.n + 1 %}
    <{{ m.role | upper }}> {{ m.content.strip() }}
    {% if m.content.startswith('Hi') %}  starts-with-Hi {{ m.content.split(' ') }}{% endif %}
    {% if m.content is string %}string{% endif %} {{ m.content.replace('o', '0').title() }}
    {% for k, v in m.items() %}{{ k }}={{ v | tojson }};{% endfor %}
    {% if m.extra is defined %}{{ m.extra }} {{ m.extra.flag }} {{ m.extra.ratio }} {{ m.extra | tojson(indent=2) }}{% endif %}
    {% if ns.n > 3 %}{% break %}{% endif %}
{% endfor %}
system={{ ns.sys }} count={{ ns.n }} {{ none }} {{ true }} {{ [1, 'a', none, false, 2.5] }} {{ 1e-5 }} {{ 3.0 }} {{ 10 / 4 }} {{ 7 // 2 }}
{{ {'k': 'v', 'n': [1, 2]} | tojson }} {{ "tab\t'q\"" | tojson }} {{ "ü中😀" | tojson(ensure_ascii=true) }}
{% if tools is none %}no tools{% endif %} {% if documents is none %}no docs{% endif %} {{ custom_var | default('dflt') }}
{%- if add_generation_prompt %}

GEN{% endif %}
"#;

pub const LLAMA2: &str = r#"{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"#;

struct Case {
    name: &'static str,
    template: &'static str,
    messages: &'static str,
    add_generation_prompt: bool,
    extra: &'static str,
    expected: &'static str,
}

const CASES: &[Case] = &[
    Case {
        name: "chatml_system",
        template: CHATML,
        messages: r#"[{"content": "You are terse. Ünïcödé ✓", "role": "system"}, {"content": "Hi there! 你好", "role": "user"}, {"content": "  Hello. 😀  ", "role": "assistant"}, {"content": "What's 2+2?\n", "role": "user"}]"#,
        add_generation_prompt: false,
        extra: r#"{}"#,
        expected: r#"<|im_start|>system
You are terse. Ünïcödé ✓<|im_end|>
<|im_start|>user
Hi there! 你好<|im_end|>
<|im_start|>assistant
  Hello. 😀  <|im_end|>
<|im_start|>user
What's 2+2?
<|im_end|>
"#,
    },
    Case {
        name: "chatml_default_system",
        template: CHATML,
        messages: r#"[{"content": "Hi there! 你好", "role": "user"}, {"content": "  Hello. 😀  ", "role": "assistant"}, {"content": "What's 2+2?\n", "role": "user"}]"#,
        add_generation_prompt: false,
        extra: r#"{}"#,
        expected: r#"<|im_start|>system
You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>
<|im_start|>user
Hi there! 你好<|im_end|>
<|im_start|>assistant
  Hello. 😀  <|im_end|>
<|im_start|>user
What's 2+2?
<|im_end|>
"#,
    },
    Case {
        name: "llama3",
        template: LLAMA3,
        messages: r#"[{"content": "You are terse. Ünïcödé ✓", "role": "system"}, {"content": "Hi there! 你好", "role": "user"}, {"content": "  Hello. 😀  ", "role": "assistant"}, {"content": "What's 2+2?\n", "role": "user"}]"#,
        add_generation_prompt: false,
        extra: r#"{"bos_token": "<|begin_of_text|>"}"#,
        expected: r#"<|begin_of_text|><|start_header_id|>system<|end_header_id|>

You are terse. Ünïcödé ✓<|eot_id|><|start_header_id|>user<|end_header_id|>

Hi there! 你好<|eot_id|><|start_header_id|>assistant<|end_header_id|>

Hello. 😀<|eot_id|><|start_header_id|>user<|end_header_id|>

What's 2+2?<|eot_id|>"#,
    },
    Case {
        name: "pyisms",
        template: PYISMS,
        messages: r#"[{"content": "You are terse. Ünïcödé ✓", "role": "system"}, {"content": "Hi there! 你好", "role": "user"}, {"content": "  Hello. 😀  ", "role": "assistant"}, {"content": "What's 2+2?\n", "role": "user"}, {"content": "Hi again to you", "extra": {"flag": true, "name": "ä", "ratio": 0.25}, "role": "user"}, {"content": "never shown", "role": "user"}]"#,
        add_generation_prompt: false,
        extra: r#"{}"#,
        expected: r#"    <USER> Hi there! 你好
  starts-with-Hi ['Hi', 'there!', '你好']string Hi There! 你好
content="Hi there! 你好";role="user";    <ASSISTANT> Hello. 😀
string   Hell0. 😀  
content="  Hello. 😀  ";role="assistant";    <USER> What's 2+2?
string What'S 2+2?

content="What's 2+2?\n";role="user";    <USER> Hi again to you
  starts-with-Hi ['Hi', 'again', 'to', 'you']string Hi Again T0 Y0U
content="Hi again to you";extra={"flag": true, "name": "ä", "ratio": 0.25};role="user";{'flag': True, 'name': 'ä', 'ratio': 0.25} True 0.25 {
  "flag": true,
  "name": "ä",
  "ratio": 0.25
}system=You are terse. Ünïcödé ✓ count=4 None True [1, 'a', None, False, 2.5] 1e-05 3.0 2.5 3
{"k": "v", "n": [1, 2]} "tab\t'q\"" "\u00fc\u4e2d\ud83d\ude00"
no tools no docs dflt"#,
    },
    Case {
        name: "chatml_system",
        template: CHATML,
        messages: r#"[{"content": "You are terse. Ünïcödé ✓", "role": "system"}, {"content": "Hi there! 你好", "role": "user"}, {"content": "  Hello. 😀  ", "role": "assistant"}, {"content": "What's 2+2?\n", "role": "user"}]"#,
        add_generation_prompt: true,
        extra: r#"{}"#,
        expected: r#"<|im_start|>system
You are terse. Ünïcödé ✓<|im_end|>
<|im_start|>user
Hi there! 你好<|im_end|>
<|im_start|>assistant
  Hello. 😀  <|im_end|>
<|im_start|>user
What's 2+2?
<|im_end|>
<|im_start|>assistant
"#,
    },
    Case {
        name: "chatml_default_system",
        template: CHATML,
        messages: r#"[{"content": "Hi there! 你好", "role": "user"}, {"content": "  Hello. 😀  ", "role": "assistant"}, {"content": "What's 2+2?\n", "role": "user"}]"#,
        add_generation_prompt: true,
        extra: r#"{}"#,
        expected: r#"<|im_start|>system
You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>
<|im_start|>user
Hi there! 你好<|im_end|>
<|im_start|>assistant
  Hello. 😀  <|im_end|>
<|im_start|>user
What's 2+2?
<|im_end|>
<|im_start|>assistant
"#,
    },
    Case {
        name: "llama3",
        template: LLAMA3,
        messages: r#"[{"content": "You are terse. Ünïcödé ✓", "role": "system"}, {"content": "Hi there! 你好", "role": "user"}, {"content": "  Hello. 😀  ", "role": "assistant"}, {"content": "What's 2+2?\n", "role": "user"}]"#,
        add_generation_prompt: true,
        extra: r#"{"bos_token": "<|begin_of_text|>"}"#,
        expected: r#"<|begin_of_text|><|start_header_id|>system<|end_header_id|>

You are terse. Ünïcödé ✓<|eot_id|><|start_header_id|>user<|end_header_id|>

Hi there! 你好<|eot_id|><|start_header_id|>assistant<|end_header_id|>

Hello. 😀<|eot_id|><|start_header_id|>user<|end_header_id|>

What's 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>

"#,
    },
    Case {
        name: "pyisms",
        template: PYISMS,
        messages: r#"[{"content": "You are terse. Ünïcödé ✓", "role": "system"}, {"content": "Hi there! 你好", "role": "user"}, {"content": "  Hello. 😀  ", "role": "assistant"}, {"content": "What's 2+2?\n", "role": "user"}, {"content": "Hi again to you", "extra": {"flag": true, "name": "ä", "ratio": 0.25}, "role": "user"}, {"content": "never shown", "role": "user"}]"#,
        add_generation_prompt: true,
        extra: r#"{}"#,
        expected: r#"    <USER> Hi there! 你好
  starts-with-Hi ['Hi', 'there!', '你好']string Hi There! 你好
content="Hi there! 你好";role="user";    <ASSISTANT> Hello. 😀
string   Hell0. 😀  
content="  Hello. 😀  ";role="assistant";    <USER> What's 2+2?
string What'S 2+2?

content="What's 2+2?\n";role="user";    <USER> Hi again to you
  starts-with-Hi ['Hi', 'again', 'to', 'you']string Hi Again T0 Y0U
content="Hi again to you";extra={"flag": true, "name": "ä", "ratio": 0.25};role="user";{'flag': True, 'name': 'ä', 'ratio': 0.25} True 0.25 {
  "flag": true,
  "name": "ä",
  "ratio": 0.25
}system=You are terse. Ünïcödé ✓ count=4 None True [1, 'a', None, False, 2.5] 1e-05 3.0 2.5 3
{"k": "v", "n": [1, 2]} "tab\t'q\"" "\u00fc\u4e2d\ud83d\ude00"
no tools no docs dflt
GEN"#,
    },
    Case {
        name: "chatml_tools",
        template: CHATML,
        messages: r#"[{"content": "Weather in Zürich?", "role": "user"}, {"content": null, "role": "assistant", "tool_calls": [{"function": {"arguments": {"city": "Zürich"}, "name": "get_weather"}, "type": "function"}]}, {"content": "{\"temp\": 21.5}", "role": "tool"}, {"content": "sunny", "role": "tool"}, {"content": "21.5 °C and sunny.", "role": "assistant"}]"#,
        add_generation_prompt: true,
        extra: r#"{"tools": [{"function": {"description": "Get the weather in a city, e.g. \"Zürich\"", "name": "get_weather", "parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}}, "type": "function"}]}"#,
        expected: r#"<|im_start|>system
You are Qwen, created by Alibaba Cloud. You are a helpful assistant.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"function": {"description": "Get the weather in a city, e.g. \"Zürich\"", "name": "get_weather", "parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}}, "type": "function"}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
Weather in Zürich?<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "get_weather", "arguments": {"city": "Zürich"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"temp": 21.5}
</tool_response>
<tool_response>
sunny
</tool_response><|im_end|>
<|im_start|>assistant
21.5 °C and sunny.<|im_end|>
<|im_start|>assistant
"#,
    },
    Case {
        name: "llama2_system",
        template: LLAMA2,
        messages: r#"[{"content": "You are terse. Ünïcödé ✓", "role": "system"}, {"content": "Hi there! 你好", "role": "user"}, {"content": "  Hello. 😀  ", "role": "assistant"}, {"content": "What's 2+2?\n", "role": "user"}]"#,
        add_generation_prompt: false,
        extra: r#"{"bos_token": "<s>", "eos_token": "</s>"}"#,
        expected: r#"<s>[INST] <<SYS>>
You are terse. Ünïcödé ✓
<</SYS>>

Hi there! 你好 [/INST] Hello. 😀 </s><s>[INST] What's 2+2? [/INST]"#,
    },
    Case {
        name: "llama2_plain",
        template: LLAMA2,
        messages: r#"[{"content": "Hi there! 你好", "role": "user"}, {"content": "  Hello. 😀  ", "role": "assistant"}]"#,
        add_generation_prompt: true,
        extra: r#"{"bos_token": "<s>", "eos_token": "</s>"}"#,
        expected: r#"<s>[INST] Hi there! 你好 [/INST] Hello. 😀 </s>"#,
    },
    Case {
        name: "pyisms_custom",
        template: PYISMS,
        messages: r#"[{"content": "Hi there! 你好", "role": "user"}, {"content": "  Hello. 😀  ", "role": "assistant"}, {"content": "What's 2+2?\n", "role": "user"}]"#,
        add_generation_prompt: false,
        extra: r#"{"custom_var": "set", "tools": [{"a": 1}]}"#,
        expected: r#"    <USER> Hi there! 你好
  starts-with-Hi ['Hi', 'there!', '你好']string Hi There! 你好
content="Hi there! 你好";role="user";    <ASSISTANT> Hello. 😀
string   Hell0. 😀  
content="  Hello. 😀  ";role="assistant";    <USER> What's 2+2?
string What'S 2+2?

content="What's 2+2?\n";role="user";system=None count=3 None True [1, 'a', None, False, 2.5] 1e-05 3.0 2.5 3
{"k": "v", "n": [1, 2]} "tab\t'q\"" "\u00fc\u4e2d\ud83d\ude00"
 no docs set"#,
    },
];

#[test]
fn renders_as_transformers_does() {
    for case in CASES {
        let messages: Value = serde_json::from_str(case.messages).unwrap();
        let extra: Map<String, Value> = serde_json::from_str(case.extra).unwrap();
        let template = ChatTemplate::new(case.template).unwrap();
        let rendered = template
            .render(&messages, case.add_generation_prompt, &extra)
            .unwrap_or_else(|err| panic!("{}: {err}", case.name));
        assert_eq!(
            rendered, case.expected,
            "{} add_generation_prompt={}",
            case.name, case.add_generation_prompt
        );
    }
}
