// node client.mjs BASE_URL KEY OTHER_KEY: what an independent A2A client sees of Ember, as one JSON object.
import { randomUUID } from 'node:crypto';
import { Role, TaskState } from '@a2a-js/sdk';
import { ClientFactory, ClientFactoryOptions, DefaultAgentCardResolver, JsonRpcTransportFactory } from '@a2a-js/sdk/client';
import { TaskNotFoundError } from '@a2a-js/sdk/errors';

const [base, key, otherKey] = process.argv.slice(2);

async function clientFor(bearer) {
  const fetchImpl = (input, init = {}) => {
    const headers = new Headers(init.headers);
    headers.set('Authorization', `Bearer ${bearer}`);
    return fetch(input, { ...init, headers });
  };
  const factory = new ClientFactory(ClientFactoryOptions.createFrom(ClientFactoryOptions.default, {
    transports: [new JsonRpcTransportFactory({ fetchImpl })],
    cardResolver: new DefaultAgentCardResolver({ fetchImpl }),
  }));
  return factory.createFromUrl(base);
}

const message = (text) => ({
  message: { messageId: randomUUID(), role: Role.ROLE_USER, parts: [{ content: { $case: 'text', value: text } }] },
});
const texts = (task) => (task.artifacts ?? []).flatMap((a) => a.parts.map((p) => p.content?.value));

const out = {};
const client = await clientFor(key);
const card = await client.getAgentCard();
out.card = { name: card.name, streaming: card.capabilities?.streaming, schemes: Object.keys(card.securitySchemes ?? {}) };
const sent = await client.sendMessage(message('hello from node'));
out.send = { state: TaskState[sent.status?.state], answer: texts(sent) };
out.stream = [];
for await (const event of client.sendMessageStream(message('stream from node'))) {
  const value = event.payload?.value;
  out.stream.push([event.payload?.$case, value?.status ? TaskState[value.status.state] : null,
                   value?.artifact ? value.artifact.parts.map((p) => p.content?.value).join('') : null]);
}
out.get = TaskState[(await client.getTask({ id: sent.id })).status.state];
try {
  await (await clientFor(otherKey)).getTask({ id: sent.id });
  out.other = 'found';
} catch (error) {
  out.other = error instanceof TaskNotFoundError ? 'TaskNotFoundError' : `${error.constructor.name}: ${error.message}`;
}
console.log(JSON.stringify(out));
