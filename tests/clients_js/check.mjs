// Runs the JavaScript clients apps use against a running llmd (URL as the first argument) and
// prints one JSON line of what they parsed, for tests/integration/test_clients.py to check.
import OpenAI from "openai";
import { Ollama } from "ollama";
import { generateText, embed, tool } from "ai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { z } from "zod";

// then optionally: the chat model, the tool choice ("required", or "auto" for a model that chooses well)
// and the embedding model
const url = process.argv[2];
const model = process.argv[3] ?? "smollm2-135m";
const toolChoice = process.argv[4] ?? "required";
const embeddingModelName = process.argv[5] ?? model;
const weather = {
  type: "function",
  function: {
    name: "get_weather",
    description: "Weather in a city",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
};
const out = {};

const openai = new OpenAI({ baseURL: `${url}/v1`, apiKey: "unused" });
const chat = await openai.chat.completions.create({
  model, messages: [{ role: "user", content: "Weather in Rome?" }], tools: [weather], tool_choice: toolChoice,
  temperature: 0,
});
out.openai_tool = chat.choices[0].message.tool_calls[0].function;
const emb = await openai.embeddings.create({ model: embeddingModelName, input: "hello" });
out.openai_embedding_width = emb.data[0].embedding.length;

const ollama = new Ollama({ host: url });
const reply = await ollama.chat({ model, messages: [{ role: "user", content: "Hi" }], options: { num_predict: 5 } });
out.ollama_reply = reply.message.content;
const oe = await ollama.embed({ model: embeddingModelName, input: "hello" });
out.ollama_embedding_width = oe.embeddings[0].length;

const llmd = createOpenAICompatible({ name: "llmd", baseURL: `${url}/v1`, apiKey: "unused" });
const gen = await generateText({
  model: llmd(model),
  prompt: "What is the weather in Rome?",
  tools: { get_weather: tool({ description: "Weather in a city", inputSchema: z.object({ city: z.string() }) }) },
  toolChoice,
  temperature: 0,
});
out.ai_sdk_tool = { toolName: gen.toolCalls[0].toolName, input: gen.toolCalls[0].input };
const embeddingModel = llmd.embeddingModel ? llmd.embeddingModel(embeddingModelName) : llmd.textEmbeddingModel(embeddingModelName);
const ae = await embed({ model: embeddingModel, value: "hello" });
out.ai_sdk_embedding_width = ae.embedding.length;

console.log(JSON.stringify(out));
