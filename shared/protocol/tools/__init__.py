"""DeepSeek-V3.2 tool calling: the DSML format of the prompt and of the model's calls (dsml), a streaming
parser for the model's output (parser), and an llguidance grammar that forces calls (grammar). Import them
from here: `shared.protocol.tools`."""

from shared.protocol.tools.dsml import (
    CALLS_LEAD,
    DSML,
    FUNCTION_CALLS_CLOSE,
    FUNCTION_CALLS_OPEN,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAMETER_CLOSE,
    PARAMETER_OPEN,
    RESULT,
    RESULTS_CLOSE,
    RESULTS_OPEN,
    ToolCall,
    ToolFunction,
    render_tool_calls,
    render_tools,
)
from shared.protocol.tools.grammar import tool_call_grammar
from shared.protocol.tools.parser import ParsedDelta, ToolCallDelta, ToolCallParser, parse_tool_calls

__all__ = ["CALLS_LEAD", "DSML", "FUNCTION_CALLS_CLOSE", "FUNCTION_CALLS_OPEN", "INVOKE_CLOSE", "INVOKE_OPEN",
           "PARAMETER_CLOSE", "PARAMETER_OPEN", "RESULT", "RESULTS_CLOSE", "RESULTS_OPEN", "ParsedDelta", "ToolCall",
           "ToolCallDelta", "ToolCallParser", "ToolFunction", "parse_tool_calls", "render_tool_calls",
           "render_tools", "tool_call_grammar"]
