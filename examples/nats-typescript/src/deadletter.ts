// The dead-letter stream (jetstream.ts) holds one advisory per message that
// JetStream stopped delivering to a consumer: it ran out of deliveries
// (max_deliver), or a consumer term()ed it. This reads them back with the
// messages they name, and re-drives the ones you choose: publishes the
// message again on its subject (a new stream message, which the consumer
// claims like any copy: replayed if the event completed meanwhile, processed
// once otherwise) and removes the advisory.
import { headers } from "nats";
import type { JetStreamClient, JetStreamManager, MsgHdrs } from "nats";

export type ParkedReason = "max_deliveries" | "terminated";

export interface Parked {
  /** The advisory's sequence in the dead-letter stream. */
  dead_letter_seq: number;
  reason: ParkedReason;
  stream: string;
  consumer: string;
  /** The message's sequence in its stream. */
  stream_seq: number;
  /** How many times it was delivered to that consumer. */
  deliveries: number;
  /** When JetStream gave up on it (the advisory's time). */
  parked_at: string;
  /** The message itself, while the stream still holds it; absent when its max_age or limits removed it. */
  message?: { subject: string; data: Buffer; headers?: MsgHdrs };
}

function isNotFound(error: unknown): boolean {
  return /no message found|not found/i.test((error as Error).message);
}

/** Every advisory in the dead-letter stream, oldest first, with the message it names. */
export async function parkedMessages(jsm: JetStreamManager, deadLetterStream: string): Promise<Parked[]> {
  const info = await jsm.streams.info(deadLetterStream);
  const parked: Parked[] = [];
  if (info.state.messages === 0) return parked;
  for (let seq = info.state.first_seq; seq <= info.state.last_seq; seq++) {
    let advisory;
    try {
      advisory = await jsm.streams.getMessage(deadLetterStream, { seq });
    } catch (error) {
      if (isNotFound(error)) continue; // removed after a re-drive
      throw error;
    }
    const body = JSON.parse(Buffer.from(advisory.data).toString("utf8"));
    const entry: Parked = {
      dead_letter_seq: seq,
      reason: advisory.subject.includes(".MAX_DELIVERIES.") ? "max_deliveries" : "terminated",
      stream: body.stream,
      consumer: body.consumer,
      stream_seq: body.stream_seq,
      deliveries: body.deliveries,
      parked_at: body.timestamp,
    };
    try {
      const message = await jsm.streams.getMessage(body.stream, { seq: body.stream_seq });
      entry.message = { subject: message.subject, data: Buffer.from(message.data), headers: message.header };
    } catch (error) {
      if (!isNotFound(error)) throw error;
    }
    parked.push(entry);
  }
  return parked;
}

/**
 * The Nats-Msg-Id of a parked message's re-drive: derived from the
 * message's own id (else its stream and sequence) and the advisory's
 * sequence, so it is the same each time this advisory is re-driven and never
 * the original's (which the duplicate window would drop while it lasts).
 */
export function redriveMsgId(parked: Parked): string {
  const original = parked.message?.headers?.get("Nats-Msg-Id");
  return `${original || `${parked.stream}/${parked.stream_seq}`}/redrive/${parked.dead_letter_seq}`;
}

/**
 * Publish a parked message again on its subject, with its headers and a
 * Nats-Msg-Id of its own (redriveMsgId), then remove its advisory. A re-drive
 * killed between the two and run again within the stream's duplicate window
 * publishes the same id: JetStream drops the second copy (the PubAck says
 * duplicate, with the first copy's sequence), so the message is in the
 * stream once. Returns the re-driven copy's stream sequence.
 */
export async function redrive(
  js: JetStreamClient,
  jsm: JetStreamManager,
  deadLetterStream: string,
  parked: Parked,
  afterPublish?: () => void,
): Promise<number> {
  if (!parked.message) {
    throw new Error(`${parked.stream} no longer holds seq ${parked.stream_seq}: nothing to re-drive`);
  }
  const copied = headers();
  const original = parked.message.headers;
  if (original) {
    for (const key of original.keys()) {
      if (key.toLowerCase().startsWith("nats-")) continue; // JetStream's own (the id is set below)
      for (const value of original.values(key)) copied.append(key, value);
    }
  }
  const ack = await js.publish(parked.message.subject, parked.message.data, { msgID: redriveMsgId(parked), headers: copied });
  afterPublish?.();
  await jsm.streams.deleteMessage(deadLetterStream, parked.dead_letter_seq);
  return ack.seq;
}
