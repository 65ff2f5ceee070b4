package main

import (
	"fmt"
	"sort"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The consumer's queues, declared the same way by the consumer and the test
// (RabbitMQ refuses a second declaration with other arguments):
//
//	<queue>               the orders: a quorum queue (durable, replicated), with a
//	                      delivery limit and <queue>.dlq as its dead-letter target
//	<queue>.retry.<delay> one per backoff step: a message waits there for <delay>
//	                      (the queue's message TTL), then RabbitMQ dead-letters it
//	                      back into <queue>
//	<queue>.dlq           the parking queue: nothing in it expires; an operator
//	                      reads it (README, "Parked messages")
//
// Why retry queues instead of Nack(requeue): a requeued message is delivered
// again at once, so a ledger outage of a minute burns through any delivery
// limit in seconds. Through the retry queues each failure waits longer, and
// when the budget is spent the message is parked with its reason.
//
// Why the delivery limit still: a failure the consumer sees is acked after
// its retry copy is published, so it never counts; what counts is a
// redelivery after a consumer or its channel died holding the message, and a
// Reject with requeue (when the retry copy cannot be published). Before
// RabbitMQ 4.3 every return counts, Nack with requeue included; from 4.3 a
// Nack with requeue and a consumer_timeout do not, hence Reject. 20
// lets a message live through 19 of those before RabbitMQ dead-letters it
// into <queue>.dlq (its x-death header then says delivery_limit).

// DefaultRetryDelays is the backoff before each retry: 7 retries, 32 min 36 s
// in all. A database failover or a deploy is ridden out several times over,
// and the budget outlasts RabbitMQ's consumer_timeout (30 min).
const DefaultRetryDelays = "1s,5s,30s,2m,10m,10m,10m"

// DefaultDeliveryLimit is x-delivery-limit on the main queue (RabbitMQ 4's default).
const DefaultDeliveryLimit = 20

// Headers set on the copies the consumer republishes.
const (
	headerRetryAttempt = "x-retry-attempt" // how many retries this copy has had
	headerParkedReason = "x-parked-reason" // why it was parked: one word, for alerts and scripts
	headerParkedDetail = "x-parked-detail" // the error, for the operator
	headerParkedFrom   = "x-parked-from"   // the queue it was consumed from
)

// ParseRetryDelays reads "1s,5s,30s".
func ParseRetryDelays(s string) ([]time.Duration, error) {
	var delays []time.Duration
	for _, part := range strings.Split(s, ",") {
		if part = strings.TrimSpace(part); part == "" {
			continue
		}
		d, err := time.ParseDuration(part)
		if err != nil || d < time.Millisecond {
			return nil, fmt.Errorf("retry delay %q: want a duration of at least 1ms", part)
		}
		delays = append(delays, d)
	}
	return delays, nil
}

// RetryQueue is the queue a message waits in for d: "<queue>.retry.30s".
func RetryQueue(queue string, d time.Duration) string {
	ms := d.Milliseconds()
	switch {
	case ms%60000 == 0:
		return fmt.Sprintf("%s.retry.%dm", queue, ms/60000)
	case ms%1000 == 0:
		return fmt.Sprintf("%s.retry.%ds", queue, ms/1000)
	default:
		return fmt.Sprintf("%s.retry.%dms", queue, ms)
	}
}

// ParkingQueue is where messages that cannot be processed wait for an operator.
func ParkingQueue(queue string) string { return queue + ".dlq" }

// QueueNames is every queue DeclareTopology declares (for a test's cleanup).
func QueueNames(queue string, delays []time.Duration) []string {
	seen := map[string]bool{}
	names := []string{queue, ParkingQueue(queue)}
	var retries []string
	for _, d := range delays {
		if name := RetryQueue(queue, d); !seen[name] {
			seen[name] = true
			retries = append(retries, name)
		}
	}
	sort.Strings(retries)
	return append(names, retries...)
}

// MainQueueArgs are the main queue's arguments: a quorum queue with a
// delivery limit, dead-lettering into the parking queue.
func MainQueueArgs(queue string, deliveryLimit int) amqp.Table {
	return amqp.Table{
		"x-queue-type":              "quorum",
		"x-delivery-limit":          int32(deliveryLimit),
		"x-dead-letter-exchange":    "", // the default exchange: routed by queue name
		"x-dead-letter-routing-key": ParkingQueue(queue),
		// Dead-lettering at least once (RabbitMQ 3.10 and later, quorum
		// queues): a message leaves the queue only once the dead-letter
		// target confirmed it, so one dead-lettered while the parking queue
		// is missing, or during a crash, is kept and dead-lettered again
		// (after a restart, at once); the default, at most once, drops it.
		// It requires overflow reject-publish.
		"x-dead-letter-strategy": "at-least-once",
		"x-overflow":             "reject-publish",
	}
}

// RetryQueueArgs are a retry queue's arguments: a quorum queue whose
// messages expire after the delay and are dead-lettered, at least once, back
// into the main queue. Every message in one retry queue has the same TTL, so
// they expire in order at its head.
func RetryQueueArgs(queue string, delay time.Duration) amqp.Table {
	return amqp.Table{
		"x-queue-type":              "quorum",
		"x-message-ttl":             int32(delay.Milliseconds()),
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": queue,
		"x-dead-letter-strategy":    "at-least-once",
		"x-overflow":                "reject-publish",
	}
}

// DeclareTopology declares the queues (idempotent with the same arguments).
func DeclareTopology(ch *amqp.Channel, queue string, delays []time.Duration, deliveryLimit int) error {
	if _, err := ch.QueueDeclare(ParkingQueue(queue), true, false, false, false,
		amqp.Table{"x-queue-type": "quorum"}); err != nil {
		return fmt.Errorf("declare %s: %w", ParkingQueue(queue), err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, MainQueueArgs(queue, deliveryLimit)); err != nil {
		return fmt.Errorf("declare %s: %w", queue, err)
	}
	for _, d := range delays {
		if _, err := ch.QueueDeclare(RetryQueue(queue, d), true, false, false, false, RetryQueueArgs(queue, d)); err != nil {
			return fmt.Errorf("declare %s: %w", RetryQueue(queue, d), err)
		}
	}
	return nil
}
