// The Node openai SDK against the real `serve`, for tests/test_node_sdk.py, which asserts on
// what this prints: one JSON line per check, {"check": name, ...what the SDK gave back}, or
// {"check": name, "error": {...}} when the check threw. The checks run one after another.
//
//   node tests/node/clients.mjs <proxy base URL, without /v1>
//
// Keys (the test's routing table): "app-key" has no limits, "limited-key" has rpm: 1.
import OpenAI, { APIError, RateLimitError, toFile } from 'openai';
import { VERSION } from 'openai/version';

const base = process.argv[2];
if (!base) {
  console.error('usage: node clients.mjs <base URL>');
  process.exit(2);
}

// What the SDK put on the wire, so a check can tell what it asked for (the embeddings'
// default encoding, the tools sent) and not only what it got back.
const sent = [];
async function recordingFetch(url, init) {
  if (typeof init?.body === 'string') {
    sent.push({ path: new URL(url).pathname, body: JSON.parse(init.body) });
  }
  return fetch(url, init);
}

function sdk(apiKey) {
  return new OpenAI({
    baseURL: `${base}/v1`, apiKey, maxRetries: 0, timeout: 20_000, fetch: recordingFetch,
  });
}

const client = sdk('app-key');
const messages = [{ role: 'user', content: 'Say hello' }];
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// Ask again every 50 ms until `done` says so (at most `seconds`); the last answer and the
// number of asks.
async function poll(ask, done, seconds = 20) {
  const until = Date.now() + seconds * 1000;
  for (let asks = 1; ; asks += 1) {
    const answer = await ask();
    if (done(answer) || Date.now() > until) return { answer, asks };
    await sleep(50);
  }
}

function lastSent(path) {
  return sent.filter((s) => s.path === path).at(-1)?.body;
}

const checks = {
  async versions() {
    return { node: process.version, openai: VERSION };
  },

  async chat() {
    const { data, response } = await client.chat.completions
      .create({ model: 'm', messages, max_tokens: 5 })
      .withResponse();
    const choice = data.choices[0];
    return {
      object: data.object, content: choice.message.content, role: choice.message.role,
      finish_reason: choice.finish_reason, usage: data.usage, request_id: data._request_id,
      tier: response.headers.get('x-proxy-tier'),
      upstream: response.headers.get('x-proxy-upstream'),
    };
  },

  async stream() {
    const stream = await client.chat.completions.create({
      model: 'm', messages, max_tokens: 5, stream: true,
      stream_options: { include_usage: true },
    });
    const chunks = [];
    for await (const chunk of stream) chunks.push(chunk);
    const last = chunks.at(-1);
    return {
      chunks: chunks.length,
      text: chunks.map((c) => c.choices[0]?.delta?.content ?? '').join(''),
      finish_reasons: chunks.map((c) => c.choices[0]?.finish_reason).filter(Boolean),
      usage: last.usage ?? null, last_choices: last.choices.length,
      usage_only_on_last: chunks.slice(0, -1).every((c) => !c.usage),
    };
  },

  async tools() {
    const tools = [{
      type: 'function',
      function: {
        name: 'get_weather', description: 'The weather in a city',
        parameters: {
          type: 'object', properties: { city: { type: 'string' } }, required: ['city'],
        },
      },
    }];
    const data = await client.chat.completions.create({
      model: 'm', max_tokens: 5, tools, tool_choice: 'auto',
      messages: [{ role: 'user', content: 'Weather in Paris?' }],
    });
    // The SDK's stream helper, which puts the chunks back together into one completion.
    const stream = client.chat.completions.stream({
      model: 'm', max_tokens: 5, tools, messages: [{ role: 'user', content: 'Weather in Paris?' }],
    });
    const streamed = (await stream.finalChatCompletion()).choices[0].message.content;
    const message = data.choices[0].message;
    return {
      object: data.object, role: message.role, content: message.content,
      tool_calls: message.tool_calls ?? null, finish_reason: data.choices[0].finish_reason,
      tools_sent: lastSent('/v1/chat/completions').tools.map((t) => t.function.name),
      streamed,
    };
  },

  async embeddings() {
    const input = ['a', 'b'];
    const byDefault = await client.embeddings.create({ model: 'm', input });
    const asked = lastSent('/v1/embeddings').encoding_format ?? null;
    const floats = await client.embeddings.create({ model: 'm', input, encoding_format: 'float' });
    return {
      default_encoding_sent: asked,
      default: byDefault.data.map((d) => d.embedding),
      float: floats.data.map((d) => d.embedding),
      usage: byDefault.usage,
    };
  },

  async responses() {
    const data = await client.responses.create({ model: 'm', input: 'hello', max_output_tokens: 5 });
    // The SDK's stream helper: the events as they come, then the response they make up.
    const stream = client.responses.stream({ model: 'm', input: 'hello', max_output_tokens: 5 });
    const events = [];
    let streamed = '';
    for await (const event of stream) {
      events.push(event.type);
      if (event.type === 'response.output_text.delta') streamed += event.delta;
    }
    const final = await stream.finalResponse();
    return {
      object: data.object, status: data.status, output_text: data.output_text,
      usage: data.usage, id: data.id, events: [...new Set(events)], streamed,
      // The helper's final response has no output_text (6.30.1 adds it to parsed ones only).
      final_text: final.output.flatMap((item) => item.content ?? [])
        .filter((part) => part.type === 'output_text').map((part) => part.text).join(''),
      final_status: final.status,
    };
  },

  async background() {
    const queued = await client.responses.create({
      model: 'm', input: 'hello later', max_output_tokens: 5, background: true,
    });
    const { answer, asks } = await poll(
      () => client.responses.retrieve(queued.id),
      (r) => !['queued', 'in_progress'].includes(r.status),
    );
    return {
      first_status: queued.status, background: queued.background, id: queued.id,
      status: answer.status, same_id: answer.id === queued.id,
      output_text: answer.output_text, usage: answer.usage, asks,
    };
  },

  async batch() {
    const ids = ['c0', 'c1', 'c2', 'c3', 'c4'];
    const jsonl = ids.map((id) => JSON.stringify({
      custom_id: id, method: 'POST', url: '/v1/chat/completions',
      body: { model: 'm', max_tokens: 3, messages: [{ role: 'user', content: `line ${id}` }] },
    })).join('\n') + '\n';
    const file = await client.files.create({
      file: await toFile(Buffer.from(jsonl), 'batch.jsonl'), purpose: 'batch',
    });
    const created = await client.batches.create({
      input_file_id: file.id, endpoint: '/v1/chat/completions', completion_window: '24h',
    });
    const { answer, asks } = await poll(
      () => client.batches.retrieve(created.id),
      (b) => ['completed', 'failed', 'expired', 'cancelled'].includes(b.status),
    );
    const content = await client.files.content(answer.output_file_id);
    const rows = (await content.text()).split('\n').filter(Boolean).map((l) => JSON.parse(l));
    return {
      file: { object: file.object, purpose: file.purpose, bytes: file.bytes },
      first_status: created.status, status: answer.status,
      request_counts: answer.request_counts, asks, error_file_id: answer.error_file_id ?? null,
      custom_ids: rows.map((r) => r.custom_id),
      status_codes: rows.map((r) => r.response?.status_code ?? null),
      contents: rows.map((r) => r.response?.body?.choices?.[0]?.message?.content ?? null),
    };
  },

  async rate_limit() {
    const limited = sdk('limited-key');
    const first = await limited.chat.completions.create({ model: 'm', messages, max_tokens: 1 });
    try {
      await limited.chat.completions.create({ model: 'm', messages, max_tokens: 1 });
      return { first: first.object, second: 'answered' };
    } catch (error) {
      if (!(error instanceof APIError)) throw error;
      return {
        first: first.object, api_error: true, rate_limit_error: error instanceof RateLimitError,
        status: error.status, code: error.code, type: error.type,
        retry_after: error.headers?.get('retry-after') ?? null,
        request_id: error.requestID ?? null, message: error.message,
      };
    }
  },
};

for (const [name, check] of Object.entries(checks)) {
  let line;
  try {
    line = { check: name, ...(await check()) };
  } catch (error) {
    line = {
      check: name,
      error: { name: error?.name, message: String(error?.message ?? error), status: error?.status },
    };
  }
  process.stdout.write(`${JSON.stringify(line)}\n`);
}
