// Stock llama.cpp's chat template and output parser (common/chat.cpp) on given answers: tools/stock_chat_parse.py
// builds it against build/stock/ and writes the reference answers of tests/server/test_toolcall_formats.py.
// stdin: {"template": "...", "tools": [...], "messages": [...], "reasoning_format": "auto", "outputs": ["..."]}
// stdout: {"prompt", "generation_prompt", "format", "parsed": [msg | {"error": ...}]}
#include "chat.h"
#include <iostream>
#include <iterator>
using json = common_json;
int main() {
    std::string in((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    json req = json::parse(in);
    auto tmpls = common_chat_templates_init(nullptr, req.at("template").template get<std::string>(),
                                            req.value("bos_token", std::string("<s>")),
                                            req.value("eos_token", std::string("</s>")));
    common_chat_templates_inputs inputs;
    inputs.messages = common_chat_msgs_parse_oaicompat(req.at("messages"));
    if (req.contains("tools")) inputs.tools = common_chat_tools_parse_oaicompat(req.at("tools"));
    inputs.parallel_tool_calls = req.value("parallel_tool_calls", true);
    inputs.reasoning_format = common_reasoning_format_from_name(req.value("reasoning_format", std::string("auto")));
    auto params = common_chat_templates_apply(tmpls.get(), inputs);
    common_chat_parser_params pp(params);
    pp.reasoning_format = inputs.reasoning_format;
    pp.parse_tool_calls = !inputs.tools.empty();
    if (!params.parser.empty()) pp.parser.load(params.parser);
    json out = json::object();
    out["prompt"] = params.prompt; out["generation_prompt"] = params.generation_prompt;
    out["format"] = std::string(common_chat_format_name(params.format)); out["parsed"] = json::array();
    for (const auto & o : req.at("outputs")) {
        try {
            auto msg = common_chat_parse(o.template get<std::string>(), false, pp);
            out["parsed"].push_back(msg.to_json_oaicompat());
        } catch (const std::exception & e) {
            json err = json::object(); err["error"] = std::string(e.what()); out["parsed"].push_back(err);
        }
    }
    std::cout << out.dump(1) << std::endl;
}
