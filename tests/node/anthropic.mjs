// The Node @anthropic-ai/sdk against the real `serve`, for tests/test_anthropic_serve.py,
// which asserts on what this prints: one JSON line per check, {"check": name, ...what the
// SDK gave back}, or {"check": name, "error": {...}} when the check threw.
//
//   node tests/node/anthropic.mjs <proxy base URL, without /v1>
//
// The test's routing table: "claude-m" is a Claude candidate (a fake of Anthropic's API the
// test runs), "sim-m" an OpenAI-style one (the simulated provider); the key "agents-key" is
// tiered low.
import Anthropic from '@anthropic-ai/sdk';
import { VERSION } from '@anthropic-ai/sdk/version';

const base = process.argv[2];
if (!base) {
  console.error('usage: node anthropic.mjs <base URL>');
  process.exit(2);
}

const client = new Anthropic({ baseURL: base, apiKey: 'agents-key', maxRetries: 0, timeout: 20_000 });
const messages = [{ role: 'user', content: 'Say hello' }];
const weather = {
  name: 'get_weather',
  description: 'The weather at a place',
  input_schema: { type: 'object', properties: { location: { type: 'string' } }, required: ['location'] },
};

function print(check, seen) {
  console.log(JSON.stringify({ check, ...seen }));
}

async function run(check, body) {
  try {
    print(check, await body());
  } catch (error) {
    print(check, { error: { name: error?.constructor?.name, message: String(error?.message), status: error?.status } });
  }
}

print('versions', { sdk: VERSION, node: process.version });

for (const model of ['claude-m', 'sim-m']) {
  await run(`json ${model}`, async () => {
    const { data, response } = await client.messages
      .create({ model, max_tokens: 5, messages, system: 'Be brief.' })
      .withResponse();
    return {
      type: data.type, role: data.role, text: data.content.filter((b) => b.type === 'text').map((b) => b.text).join(''),
      stop_reason: data.stop_reason, usage: data.usage, request_id: data._request_id,
      tier: response.headers.get('x-proxy-tier'), upstream: response.headers.get('x-proxy-upstream'),
    };
  });
  await run(`stream ${model}`, async () => {
    const stream = client.messages.stream({ model, max_tokens: 5, messages });
    const kinds = [];
    stream.on('streamEvent', (event) => kinds.push(event.type));
    const final = await stream.finalMessage();
    return {
      text: final.content.filter((b) => b.type === 'text').map((b) => b.text).join(''),
      stop_reason: final.stop_reason, output_tokens: final.usage.output_tokens,
      first: kinds[0], last: kinds.at(-1),
    };
  });
  await run(`tools ${model}`, async () => {
    const data = await client.messages.create({ model, max_tokens: 5, messages, tools: [weather] });
    return { stop_reason: data.stop_reason, blocks: data.content.map((b) => b.type) };
  });
}

await run('count_tokens', async () => {
  const counted = await client.messages.countTokens({ model: 'claude-m', messages });
  return { input_tokens: counted.input_tokens };
});

await run('error', async () => {
  try {
    await client.messages.create({ model: 'no-such-model', max_tokens: 5, messages });
    return { thrown: false };
  } catch (error) {
    return { thrown: true, name: error.constructor.name, status: error.status, type: error.error?.error?.type, request_id: error.requestID };
  }
});
