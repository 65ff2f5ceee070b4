package main

// The consumer's publisher (retry and park copies) on its own, in this
// process, against a RabbitMQ node of the test's own that is restarted in
// the middle of a stream of publishes.

import (
	"bytes"
	"errors"
	"fmt"
	"log"
	"os"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// syncBuffer is the log's output while a test reads it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func (b *syncBuffer) count(pattern string) int {
	return len(regexp.MustCompile(`(?m)`+pattern).FindAllString(b.String(), -1))
}

// captureLog sends the log (the publisher's lines) to a buffer for the test.
func captureLog(t *testing.T) *syncBuffer {
	buf := &syncBuffer{}
	log.SetOutput(buf)
	t.Cleanup(func() { log.SetOutput(os.Stderr) })
	return buf
}

// publishAttempt is one call of publish in the stream.
type publishAttempt struct {
	seq   int
	err   error
	start time.Time
	took  time.Duration
}

// Issue 33, defect 3, a broker restart mid-publish. On a RabbitMQ node of
// the test's own, the publisher publishes a stream of messages into a quorum
// queue, one after another, each tried again at once while publish fails
// (as a caller that must get every message out does). After 100 confirms
// the node is stopped (SIGTERM) and started again while the stream goes on,
// and the stream runs until 100 more are confirmed. Then:
//
//   - every message is in the queue: once if its first publish was
//     confirmed, at most once per attempt if a publish of it failed (a
//     publish whose channel closed before its confirm may have been taken);
//     nothing else is there;
//   - the failures are one run around the restart, each failed publish took
//     at most the publisher's timeout, and there were at most as many as
//     the node's downtime allows (one per timeout, and the publish in
//     flight): no storm; so were the connection attempts (the backoff);
//   - the publisher opened exactly one new connection and one new channel;
//   - a copy for a queue that does not exist (mandatory) is reported as
//     returned (*returnedError, NO_ROUTE), not confirmed, on the reopened
//     channel, and the next publish goes out on the same channel.
//
// Without the reopening, every publish after the restart failed at once on
// the dead connection; without mandatory, the unroutable copy was confirmed.
func TestPublisherThroughABrokerRestartMidPublish(t *testing.T) {
	node := startPrivateRabbit(t)
	queue := "publisher-restart"
	b := dialBroker(t, node.url())
	if _, err := b.ch.QueueDeclare(queue, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatal(err)
	}
	b.conn.Close()

	logs := captureLog(t)
	defer func() { t.Logf("the publisher's log:\n%s", logs.String()) }()
	const timeout = 5 * time.Second
	const triesPerMessage = 20
	pub, err := newPublisher(node.url(), timeout)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.close()

	var confirmed int64
	var attempts []publishAttempt // the stream's, read once finished is closed
	stop, finished := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(finished)
		for seq := 1; ; seq++ {
			select {
			case <-stop:
				return
			default:
			}
			id := fmt.Sprintf("p-%04d", seq)
			msg := amqp.Publishing{MessageId: id, ContentType: "application/json", DeliveryMode: amqp.Persistent, Body: body(id, int64(seq))}
			for try := 1; ; try++ {
				start := time.Now()
				err := pub.publish(queue, msg)
				attempts = append(attempts, publishAttempt{seq: seq, err: err, start: start, took: time.Since(start)})
				if err == nil {
					atomic.AddInt64(&confirmed, 1)
					break
				}
				if try == triesPerMessage {
					return // given up: the test fails below
				}
			}
		}
	}()
	waitForStream := func(what string, limit time.Duration, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(limit)
		for !cond() {
			select {
			case <-finished:
				last, first := attempts[len(attempts)-1], attempts[len(attempts)-triesPerMessage]
				t.Fatalf("the stream stopped while waiting for %s: message %d failed %d times in %s, the last: %v",
					what, last.seq, triesPerMessage, last.start.Add(last.took).Sub(first.start).Round(time.Microsecond), last.err)
			default:
			}
			if time.Now().After(deadline) {
				t.Fatalf("no %s after %s (%d confirmed)", what, limit, atomic.LoadInt64(&confirmed))
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	waitForStream("100 confirms before the restart", 30*time.Second, func() bool { return atomic.LoadInt64(&confirmed) >= 100 })
	stopped := time.Now()
	node.stop()
	node.start()
	downtime := time.Since(stopped)
	afterRestart := atomic.LoadInt64(&confirmed)
	t.Logf("the node was down for %s; %d messages confirmed before it was back", downtime.Round(time.Millisecond), afterRestart)
	waitForStream("100 confirms after the restart", 30*time.Second+2*timeout, func() bool { return atomic.LoadInt64(&confirmed) >= afterRestart+100 })
	close(stop)
	select {
	case <-finished:
	case <-time.After(2 * timeout):
		t.Fatal("the stream did not stop")
	}

	// The stream's outcomes, per message.
	var failures []publishAttempt
	tries, failed := map[int]int{}, map[int]int{}
	last := 0
	for i, a := range attempts {
		tries[a.seq]++
		last = a.seq
		if a.err == nil {
			continue
		}
		failed[a.seq]++
		failures = append(failures, a)
		t.Logf("message %d, attempt %d, failed after %s: %v", a.seq, tries[a.seq], a.took.Round(time.Millisecond), a.err)
		var returned *returnedError
		if errors.As(a.err, &returned) {
			t.Errorf("message %d reported as returned (%v), but its queue exists", a.seq, a.err)
		}
		if a.took > timeout+time.Second {
			t.Errorf("message %d: a failed publish took %s, more than the timeout (%s)", a.seq, a.took, timeout)
		}
		if i > 0 && attempts[i-1].err == nil && len(failures) > 1 {
			t.Errorf("message %d: a failure after a confirm that followed earlier failures: the failures are not one run around the restart", a.seq)
		}
	}
	if len(failures) == 0 {
		t.Error("no publish failed: the restart did not hit the stream")
	}
	// One failure per timeout while the node was down, the publish in
	// flight when it went, and one on a channel closing as it was used.
	if limit := int(downtime/timeout) + 3; len(failures) > limit {
		t.Errorf("%d failed publishes in a downtime of %s, want at most %d (a storm)", len(failures), downtime, limit)
	}
	// Connection attempts: one per backoff (100 ms doubling to 1 s).
	dials := logs.count(`publisher: connecting: `)
	if limit := int(downtime/publisherMaxBackoff) + 5; dials > limit {
		t.Errorf("%d failed connection attempts in a downtime of %s, want at most %d (a storm)", dials, downtime, limit)
	}
	if n := logs.count(`publisher: a new connection$`); n != 1 {
		t.Errorf("%d new connections, want 1 (after the restart)", n)
	}
	if n := logs.count(`publisher: a new channel$`); n != 1 {
		t.Errorf("%d new channels, want 1 (on the new connection)", n)
	}

	// Unroutable, on the reopened channel: returned, not confirmed; the
	// channel stays.
	err = pub.publish(queue+"-nowhere", amqp.Publishing{MessageId: "p-nowhere", DeliveryMode: amqp.Persistent, Body: body("p-nowhere", 1)})
	var returned *returnedError
	if !errors.As(err, &returned) || returned.returned.ReplyCode != amqp.NoRoute {
		t.Errorf("the copy for a queue that does not exist: %v, want it returned (NO_ROUTE)", err)
	}
	if err := pub.publish(queue, amqp.Publishing{MessageId: "p-after", DeliveryMode: amqp.Persistent, Body: body("p-after", 2)}); err != nil {
		t.Errorf("the publish after the returned one: %v", err)
	}
	if n := logs.count(`publisher: a new channel$`); n != 1 {
		t.Errorf("%d new channels after the returned copy, want still 1 (a return does not close the channel)", n)
	}

	// The queue: every message, each as often as its attempts allow.
	b = dialBroker(t, node.url())
	inQueue := map[string]int{}
	for _, d := range b.drain(t, queue) {
		inQueue[d.MessageId]++
		var seq int
		if _, err := fmt.Sscanf(d.MessageId, "p-%d", &seq); err == nil && string(d.Body) != string(body(d.MessageId, int64(seq))) {
			t.Errorf("message %s: body %s", d.MessageId, d.Body)
		}
	}
	var duplicated []string
	for seq := 1; seq <= last; seq++ {
		id := fmt.Sprintf("p-%04d", seq)
		n := inQueue[id]
		delete(inQueue, id)
		switch {
		case n == 0:
			t.Errorf("message %s: not in the queue (%d attempts, %d failed): lost", id, tries[seq], failed[seq])
		case failed[seq] == 0 && n != 1:
			t.Errorf("message %s: %d copies in the queue, want 1 (its only publish was confirmed)", id, n)
		case n > tries[seq]:
			t.Errorf("message %s: %d copies in the queue, more than its %d attempts", id, n, tries[seq])
		case n > 1:
			duplicated = append(duplicated, id)
		}
	}
	if inQueue["p-after"] != 1 {
		t.Errorf("the message after the returned one: %d copies, want 1", inQueue["p-after"])
	}
	delete(inQueue, "p-after")
	if len(inQueue) != 0 {
		t.Errorf("in the queue besides the stream: %v (the returned copy must be nowhere)", inQueue)
	}
	t.Logf("%d messages, %d publishes, %d failed (%s), %d connection attempts failed, duplicates (a failed attempt taken after all): %s",
		last, len(attempts), len(failures), kinds(failures), dials, strings.Join(duplicated, " "))
}

// kinds sums up the failures' errors.
func kinds(failures []publishAttempt) string {
	var out []string
	for _, f := range failures {
		out = append(out, fmt.Sprintf("%d: %.60s", f.seq, f.err))
	}
	return strings.Join(out, "; ")
}
