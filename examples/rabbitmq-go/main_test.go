package main

// Against the real RabbitMQ ($RABBITMQ_URL, default guest on 127.0.0.1:5672)
// and a real idempotency-service (started here on a free port): publish
// orders, some twice and one with an altered body, consume them with the
// consumer above in a child process, SIGKILL it three times, each while it
// hangs at another point of an order's handling (after Claim, after the
// effect, after Complete but before the ack), restart it, and check that
// every order's effect is in the ledger once, written by the newest lease.
//
// Then the cases around it: a late copy after the order's result expired,
// while the service remembers the order (re-executed under the next token)
// and after it forgot it (token 1 again), each with the same body and
// another body; a ledger outage longer than the retry
// budget (parked, then moved back and applied once); the queue as the broker
// holds it (durable, quorum, declared against a queue that exists), and a
// restart of a private RabbitMQ node with a message in the queue.

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"idempotencyservice/idempotency"
	"idempotencyservice/idempotency/idempotencytest"
)

// The test binary is also the consumer: run with this variable set, it runs main().
const consumerEnv = "RABBITMQ_GO_EXAMPLE_CONSUMER"

func TestMain(m *testing.M) {
	if os.Getenv(consumerEnv) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func amqpURL() string {
	if url := os.Getenv("RABBITMQ_URL"); url != "" {
		return url
	}
	return "amqp://guest:guest@127.0.0.1:5672/"
}

// consumer is one run of the consumer process; its log goes to a file.
type consumer struct {
	cmd    *exec.Cmd
	log    string
	exited chan struct{}
}

func startConsumer(t *testing.T, dir string, run int, args ...string) *consumer {
	t.Helper()
	return startConsumerUnder(t, dir, run, nil, args...)
}

// startConsumerUnder runs the consumer as the last argument of wrapper (a
// tracer): wrapper..., the consumer, args.
func startConsumerUnder(t *testing.T, dir string, run int, wrapper []string, args ...string) *consumer {
	t.Helper()
	logPath := filepath.Join(dir, fmt.Sprintf("consumer-%d.log", run))
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	argv := append(append(append([]string{}, wrapper...), os.Args[0]), args...)
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), consumerEnv+"=1")
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &consumer{cmd: cmd, log: logPath, exited: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(c.exited) }()
	t.Cleanup(func() { c.signal(syscall.SIGKILL) })
	return c
}

func (c *consumer) signal(sig syscall.Signal) {
	select {
	case <-c.exited:
	default:
		_ = c.cmd.Process.Signal(sig)
		<-c.exited
	}
}

func (c *consumer) lines() []string {
	data, _ := os.ReadFile(c.log)
	return strings.Split(strings.TrimSpace(string(data)), "\n")
}

// waitFor polls until cond is true, failing after the deadline or if a
// consumer run exits meanwhile.
func waitFor(t *testing.T, what string, timeout time.Duration, c *consumer, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		select {
		case <-c.exited:
			t.Fatalf("the consumer exited while waiting for %s:\n%s", what, strings.Join(c.lines(), "\n"))
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s after %s; consumer log:\n%s", what, timeout, strings.Join(c.lines(), "\n"))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func contains(c *consumer, pattern string) func() bool {
	re := regexp.MustCompile(pattern)
	return func() bool {
		for _, line := range c.lines() {
			if re.MatchString(line) {
				return true
			}
		}
		return false
	}
}

// The test's retry budget (two retries, then parked) and delivery limit.
var testRetryDelays = []time.Duration{200 * time.Millisecond, 400 * time.Millisecond}

const (
	testRetryDelaysFlag  = "200ms,400ms"
	testDeliveryLimit    = 5
	testDeliveryLimitArg = "5"
)

func randomSuffix(t *testing.T) string {
	suffix := make([]byte, 6)
	if _, err := rand.Read(suffix); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(suffix)
}

// broker is a connection and channel to a RabbitMQ for the test's own use.
type broker struct {
	url      string
	conn     *amqp.Connection
	ch       *amqp.Channel
	confirms chan amqp.Confirmation
}

func dialBroker(t *testing.T, url string) *broker {
	t.Helper()
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatalf("RabbitMQ at %s: %v", url, err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	// One listener for the channel's life: the library blocks on a full one.
	b := &broker{url: url, conn: conn, ch: ch, confirms: ch.NotifyPublish(make(chan amqp.Confirmation, 1024))}
	t.Cleanup(func() { conn.Close() })
	return b
}

// declareTopology declares the consumer's queues as the consumer does and
// deletes them when the test ends.
func (b *broker) declareTopology(t *testing.T, queue string) {
	t.Helper()
	if err := DeclareTopology(b.ch, queue, testRetryDelays, testDeliveryLimit); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, name := range QueueNames(queue, testRetryDelays) {
			if _, err := b.ch.QueueDelete(name, false, false, false); err != nil {
				t.Errorf("delete queue %s: %v", name, err)
			}
		}
	})
}

// publish publishes bodies to a queue and waits for the broker's confirms
// (through NotifyPublish: amqp091-go 1.5's deferred confirmations can miss an
// ack that arrives before they are registered).
func (b *broker) publish(t *testing.T, queue string, msgs ...amqp.Publishing) {
	t.Helper()
	for _, msg := range msgs {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if msg.ContentType == "" {
			msg.ContentType = "application/json"
		}
		msg.DeliveryMode = amqp.Persistent
		err := b.ch.PublishWithContext(ctx, "", queue, false, false, msg)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
	}
	for range msgs {
		select {
		case confirm := <-b.confirms:
			if !confirm.Ack {
				t.Fatalf("the broker refused publish %d", confirm.DeliveryTag)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the broker did not confirm every publish within 10 s")
		}
	}
}

func (b *broker) depth(t *testing.T, queue string) int {
	t.Helper()
	q, err := b.ch.QueueDeclarePassive(queue, false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return q.Messages
}

// drain takes every message out of a queue.
func (b *broker) drain(t *testing.T, queue string) []amqp.Delivery {
	t.Helper()
	var out []amqp.Delivery
	for {
		d, ok, err := b.ch.Get(queue, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			return out
		}
		out = append(out, d)
	}
}

func body(id string, amount int64) []byte {
	return []byte(fmt.Sprintf(`{"order_id":%q,"amount_cents":%d}`, id, amount))
}

func sha(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// appliedLog is applied.log: the tokens each order's effect was written under.
func appliedLog(t *testing.T, ledgerDir string) map[string][]string {
	t.Helper()
	applied := map[string][]string{}
	logFile, err := os.Open(filepath.Join(ledgerDir, "applied.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	scanner := bufio.NewScanner(logFile)
	for scanner.Scan() {
		fields := strings.Fields(scanner.Text())
		applied[fields[0]] = append(applied[fields[0]], fields[1])
	}
	return applied
}

func matching(c *consumer, pattern string) []string {
	re := regexp.MustCompile(pattern)
	var out []string
	for _, line := range c.lines() {
		if re.MatchString(line) {
			out = append(out, line)
		}
	}
	return out
}

func TestEveryOrderTakesEffectOnceThroughDuplicatesAndKilledConsumers(t *testing.T) {
	server := idempotencytest.Start(t)
	client := server.Client(t)
	dir := t.TempDir()
	ledgerDir := filepath.Join(dir, "ledger")
	queue := "idempotency-go-example-" + randomSuffix(t)
	namespace := "examples/rabbitmq-go/" + queue
	b := dialBroker(t, amqpURL())
	b.declareTopology(t, queue)

	// 12 orders; 4 of them published twice (a publisher's retry), and order
	// o-03 once more with another amount (not a duplicate: a mismatch).
	orders := map[string]int64{}
	var bodies []string
	for i := 1; i <= 12; i++ {
		id := fmt.Sprintf("o-%02d", i)
		orders[id] = int64(1000 + i)
		bodies = append(bodies, fmt.Sprintf(`{"order_id":%q,"amount_cents":%d}`, id, orders[id]))
	}
	for _, id := range []string{"o-02", "o-05", "o-08", "o-11"} {
		bodies = append(bodies, fmt.Sprintf(`{"order_id":%q,"amount_cents":%d}`, id, orders[id]))
	}
	bodies = append(bodies, `{"order_id":"o-03","amount_cents":1}`)
	var msgs []amqp.Publishing
	for _, body := range bodies {
		msgs = append(msgs, amqp.Publishing{Body: []byte(body)})
	}
	b.publish(t, queue, msgs...)

	args := consumerArgs(queue, server.Target, namespace, ledgerDir)

	// Each run but the last hangs at one point of one order's handling and
	// is killed there with SIGKILL; the next run starts on the redelivery.
	holds := []struct{ order, point string }{
		{"o-04", "applied"},   // effect written, no Complete: the next lease redoes it (token 2)
		{"o-07", "claimed"},   // lease held, no effect: the next lease does it (token 2)
		{"o-10", "completed"}, // receipt stored, no ack: the redelivery is a replay
	}
	var runs []*consumer
	for i, hold := range holds {
		run := startConsumer(t, dir, i+1, append(args, "-hold", hold.order+"@"+hold.point)...)
		runs = append(runs, run)
		what := fmt.Sprintf("holding order=%s at=%s", hold.order, hold.point)
		waitFor(t, what, 30*time.Second, run, contains(run, what+"$"))
		run.signal(syscall.SIGKILL)
	}
	// The last run finishes the queue.
	last := startConsumer(t, dir, len(holds)+1, args...)
	runs = append(runs, last)
	defer func() {
		for i, run := range runs {
			t.Logf("consumer run %d:\n%s", i+1, strings.Join(run.lines(), "\n"))
		}
	}()
	done := regexp.MustCompile(`done order=(o-\d+) replayed=(true|false) wrote=(true|false) token=(\d+)$`)
	var doneLines []string
	waitFor(t, "16 acked deliveries", 60*time.Second, last, func() bool {
		doneLines = nil
		for _, run := range runs {
			for _, line := range run.lines() {
				if done.MatchString(line) {
					doneLines = append(doneLines, line)
				}
			}
		}
		return len(doneLines) >= 16 && contains(last, `park order=o-03 reason=conflicts_with_applied_order`)()
	})
	last.signal(syscall.SIGTERM)
	if code := last.cmd.ProcessState.ExitCode(); code != 0 {
		t.Errorf("the last run exited with %d after SIGTERM", code)
	}
	if len(doneLines) != 16 {
		t.Errorf("%d acked deliveries, want 16:\n%s", len(doneLines), strings.Join(doneLines, "\n"))
	}

	// Nothing is left in the queue: every delivery was acked, the mismatch
	// after its copy went to the parking queue. (A quorum queue forgets a
	// consumer whose connection closed a moment later: wait for it.)
	var q amqp.Queue
	deadline := time.Now().Add(10 * time.Second)
	for {
		var err error
		if q, err = b.ch.QueueDeclarePassive(queue, false, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		if q.Consumers == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if q.Messages != 0 || q.Consumers != 0 {
		t.Errorf("queue %s: %d messages, %d consumers left, want none", queue, q.Messages, q.Consumers)
	}
	parked := b.drain(t, ParkingQueue(queue))
	if len(parked) != 1 || string(parked[0].Body) != `{"order_id":"o-03","amount_cents":1}` ||
		parked[0].Headers[headerParkedReason] != "conflicts_with_applied_order" {
		// Parked by the ledger check before any Claim (issue 33, defect 9).
		t.Errorf("parking queue: %d messages (%v), want o-03's altered copy as conflicts_with_applied_order", len(parked), parked)
	}

	// Each order once in the ledger, with its own amount (o-03's altered copy
	// changed nothing); the orders killed before their Complete written by
	// the lease that took them over.
	ledger, err := OpenLedger(ledgerDir)
	if err != nil {
		t.Fatal(err)
	}
	entries, err := ledger.Entries()
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != len(orders) {
		t.Errorf("%d ledger entries, want %d: %v", len(entries), len(orders), entries)
	}
	for id, amount := range orders {
		want := Entry{OrderID: id, AmountCents: amount, FencingToken: 1, BodySHA256: sha(body(id, amount))}
		if id == "o-04" || id == "o-07" {
			want.FencingToken = 2
		}
		if entries[id] != want {
			t.Errorf("ledger %s: %+v, want %+v", id, entries[id], want)
		}
	}

	// The effect ran once per order, except where a consumer was killed
	// between the effect and Complete: there the next lease holder (token 2)
	// redid the fenced write. Killed before the effect, only token 2 wrote it.
	applied := appliedLog(t, ledgerDir)
	for id := range orders {
		want := map[string]string{"o-04": "1 2", "o-07": "2"}[id]
		if want == "" {
			want = "1"
		}
		if got := strings.Join(applied[id], " "); got != want {
			t.Errorf("the effect of %s ran under tokens [%s], want [%s]", id, got, want)
		}
	}

	// The duplicates were replays, and so was o-10's redelivery (its
	// consumer died after Complete, before the ack): 11 first runs acked, 5 replays.
	replayed := map[string]int{}
	for _, line := range doneLines {
		m := done.FindStringSubmatch(line)
		if m[2] == "true" {
			replayed[m[1]]++
		}
	}
	var replayedIDs []string
	for id, n := range replayed {
		replayedIDs = append(replayedIDs, fmt.Sprintf("%s×%d", id, n))
	}
	sort.Strings(replayedIDs)
	if got := strings.Join(replayedIDs, " "); got != "o-02×1 o-05×1 o-08×1 o-10×1 o-11×1" {
		t.Errorf("replays: %s, want the four duplicates and o-10's redelivery once each", got)
	}

	// The service holds every order's receipt.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for id := range orders {
		record, err := client.Get(ctx, namespace, idempotency.MustDeriveKey("examples/rabbitmq-go", "order", id))
		if err != nil {
			t.Fatal(err)
		}
		var receipt Entry
		if record.State != idempotency.StateCompleted || json.Unmarshal(record.Response, &receipt) != nil || receipt != entries[id] {
			t.Errorf("%s: %s %s, want COMPLETED with the ledger entry", id, record.State, record.Response)
		}
	}
}

// consumerArgs are the consumer's flags in the tests: 2 s leases (a killed
// consumer's orders free up quickly), a wait longer than that, the small
// retry budget and delivery limit.
func consumerArgs(queue, target, namespace, ledgerDir string, extra ...string) []string {
	return append([]string{"-amqp", amqpURL(), "-queue", queue, "-target", target,
		"-namespace", namespace, "-ledger", ledgerDir, "-lease", "2s", "-wait", "7s",
		"-retry-delays", testRetryDelaysFlag, "-delivery-limit", testDeliveryLimitArg}, extra...)
}

// serverStats runs the server binary's `stats` on the server's store.
func serverStats(t *testing.T, server *idempotencytest.Server) string {
	t.Helper()
	cmd := exec.Command(idempotencytest.Binary(), "stats")
	cmd.Env = append(os.Environ(), "IDEMPOTENCY_DATA_DIR="+server.DataDir, "IDEMPOTENCY_METRICS_ADDR=")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("idempotency-service stats: %v\n%s", err, out)
	}
	return string(out)
}

// Issue 24. An order completes with a 1 s retention; its receipt expires and
// the service remembers the order (7 days by default), so a late copy is
// re-executed: claimed under the NEXT fencing token, with the time the order
// completed before. The same body rewrites the same entry under token 2 (one
// entry, the same amount) and the consumer logs the late retry; another body
// under the same order id, twice, is parked both times before any Claim (the
// ledger holds the order with another body), the entry untouched; then the
// first body again is re-executed under token 3 and acked (issue 33, defect
// 9: it was parked as fingerprint_mismatch).
func TestLateCopyWithinRememberForIsReexecuted(t *testing.T) {
	// The server refuses late retries unless a Claim says otherwise: the
	// consumer pins WithLateRetry(LateRetryReexecute), so its late copy is
	// re-executed whatever the server's or the namespace's policy (issue 33,
	// defect 6).
	server := idempotencytest.Start(t, "IDEMPOTENCY_REAPER_INTERVAL=1s", "IDEMPOTENCY_LATE_RETRY=refuse")
	client := server.Client(t)
	dir := t.TempDir()
	ledgerDir := filepath.Join(dir, "ledger")
	queue := "idempotency-go-example-" + randomSuffix(t)
	namespace := "examples/rabbitmq-go/" + queue
	b := dialBroker(t, amqpURL())
	b.declareTopology(t, queue)
	run := startConsumer(t, dir, 1, consumerArgs(queue, server.Target, namespace, ledgerDir, "-retention", "1s")...)
	defer func() { t.Logf("consumer:\n%s", strings.Join(run.lines(), "\n")) }()
	key := idempotency.MustDeriveKey("examples/rabbitmq-go", "order", "o-late")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	get := func() *idempotency.Record {
		record, err := client.Get(ctx, namespace, key)
		if err != nil {
			t.Fatal(err)
		}
		return record
	}
	var marker *idempotency.Record
	waitRemembered := func(token uint64) {
		waitFor(t, "the receipt to expire and the order to be remembered", 30*time.Second, run, func() bool {
			marker = get()
			return marker.Remembered() && marker.FencingToken == token
		})
	}
	first := body("o-late", 500)
	want := Entry{OrderID: "o-late", AmountCents: 500, FencingToken: 2, BodySHA256: sha(first)}

	b.publish(t, queue, amqp.Publishing{Body: first})
	waitFor(t, "the first copy", 30*time.Second, run, contains(run, `done order=o-late replayed=false wrote=true token=1$`))
	waitRemembered(1)

	// (a) The same body within remember_for: re-executed under token 2.
	b.publish(t, queue, amqp.Publishing{Body: first})
	waitFor(t, "the late copy's ack", 30*time.Second, run, contains(run, `done order=o-late replayed=false wrote=true token=2$`))
	pid := run.cmd.Process.Pid
	wantLines := []string{
		fmt.Sprintf("consumer[%d] late retry order=o-late token=2 completed_before=%s", pid, marker.CompletedAt.UTC().Format(time.RFC3339Nano)),
		fmt.Sprintf("consumer[%d] applied order=o-late token=2 wrote=true", pid),
	}
	if got := matching(run, `(late retry|applied) order=o-late token=2 `); strings.Join(got, "\n") != strings.Join(wantLines, "\n") {
		t.Errorf("the late copy's log:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(wantLines, "\n"))
	}
	record := get()
	var receipt Entry
	if record.State != idempotency.StateCompleted || record.FencingToken != 2 || json.Unmarshal(record.Response, &receipt) != nil || receipt != want {
		t.Errorf("record after the late copy: %s token %d %s, want COMPLETED under token 2 with %+v", record.State, record.FencingToken, record.Response, want)
	}
	waitRemembered(2)

	// (b) Another body under the same order id, twice.
	other := body("o-late", 999)
	b.publish(t, queue, amqp.Publishing{Body: other}, amqp.Publishing{Body: other})
	waitFor(t, "both other-body copies parked", 30*time.Second, run, func() bool {
		return len(matching(run, `park order=o-late reason=conflicts_with_applied_order`)) == 2
	})
	ledger, _ := OpenLedger(ledgerDir)
	entries, err := ledger.Entries()
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 1 || entries["o-late"] != want {
		t.Errorf("ledger: %+v, want only %+v", entries, want)
	}
	if got := strings.Join(appliedLog(t, ledgerDir)["o-late"], " "); got != "1 2" {
		t.Errorf("the effect of o-late was written under tokens [%s], want [1 2]", got)
	}
	want.FencingToken = 3 // (c) below rewrites it under token 3
	// Parked before any Claim: the order stays remembered under token 2,
	// with the first body's fingerprint.
	if got := matching(run, `start order=o-late `); len(got) != 2 {
		t.Errorf("the Claims of o-late: %q, want tokens 1 and 2 only", got)
	}
	if record := get(); !record.Remembered() || record.FencingToken != 2 || hex.EncodeToString(record.Fingerprint) != sha(first) {
		t.Errorf("record after the other bodies: %s token %d, want remembered under token 2 with the first body's fingerprint", record.State, record.FencingToken)
	}

	// (c) Issue 33, defect 9: the first body again, after the conflicts: a
	// duplicate, re-executed under token 3 and acked. It was parked as
	// fingerprint_mismatch: the other bodies had been Claimed, refused by
	// the ledger and released, leaving the key holding their fingerprint.
	b.publish(t, queue, amqp.Publishing{Body: first})
	waitFor(t, "the copy of the applied body acked", 30*time.Second, run, func() bool {
		return contains(run, `done order=o-late replayed=false wrote=true token=3$`)() ||
			len(matching(run, `park order=o-late reason=fingerprint_mismatch`)) > 0
	})
	if got := matching(run, `park order=o-late reason=fingerprint_mismatch`); len(got) != 0 {
		t.Fatalf("the copy of the applied body was parked: %q", got)
	}
	parked := b.drain(t, ParkingQueue(queue))
	if len(parked) != 2 {
		t.Fatalf("%d parked messages, want 2", len(parked))
	}
	for _, d := range parked {
		if string(d.Body) != string(other) || d.Headers[headerParkedReason] != "conflicts_with_applied_order" ||
			!strings.Contains(fmt.Sprint(d.Headers[headerParkedDetail]), "500 cents under token 2") {
			t.Errorf("parked: %s %v, want the other body as conflicts_with_applied_order", d.Body, d.Headers)
		}
	}
	for _, name := range QueueNames(queue, testRetryDelays)[2:] {
		if n := b.depth(t, name); n != 0 {
			t.Errorf("%s holds %d messages, want 0", name, n)
		}
	}
	if entries, err := ledger.Entries(); err != nil || len(entries) != 1 || entries["o-late"] != want {
		t.Errorf("ledger after (c): %+v (%v), want only %+v", entries, err, want)
	}
}

// Issue 26, defect 1, and issue 24 past the horizon. An order completes with
// a 1 s retention on a server that remembers nothing past it
// (IDEMPOTENCY_REMEMBER_FOR=0s: what any server does past an order's
// horizon); its record expires and the reaper deletes it (the server's store
// is empty), so the next Claim of the key starts again at fencing token 1,
// the token the ledger entry already has. The same body again completes
// with the entry as its receipt, nothing written; another body under the
// same order id, twice, is parked both times before any Claim, the amount
// untouched.
func TestLateCopyAfterTheServiceForgotTheOrder(t *testing.T) {
	server := idempotencytest.Start(t, "IDEMPOTENCY_REAPER_INTERVAL=1s", "IDEMPOTENCY_REMEMBER_FOR=0s")
	client := server.Client(t)
	dir := t.TempDir()
	ledgerDir := filepath.Join(dir, "ledger")
	queue := "idempotency-go-example-" + randomSuffix(t)
	namespace := "examples/rabbitmq-go/" + queue
	b := dialBroker(t, amqpURL())
	b.declareTopology(t, queue)
	run := startConsumer(t, dir, 1, consumerArgs(queue, server.Target, namespace, ledgerDir, "-retention", "1s")...)
	defer func() { t.Logf("consumer:\n%s", strings.Join(run.lines(), "\n")) }()
	waitReaped := func() {
		waitFor(t, "the record to expire and be reaped", 30*time.Second, run, func() bool {
			// No row at all: not live, not expired either (awaiting the
			// reaper), and no marker.
			return strings.Contains(serverStats(t, server),
				"records: in_progress 0 completed 0 released 0 expired (awaiting the reaper) 0\n"+
					"remembered keys (markers, no result): 0\n")
		})
	}
	key := idempotency.MustDeriveKey("examples/rabbitmq-go", "order", "o-late")
	first := body("o-late", 500)
	want := Entry{OrderID: "o-late", AmountCents: 500, FencingToken: 1, BodySHA256: sha(first)}

	b.publish(t, queue, amqp.Publishing{Body: first})
	waitFor(t, "the first copy", 30*time.Second, run, contains(run, `done order=o-late replayed=false wrote=true token=1$`))
	waitReaped()

	// (a) The same body after the reaping: completed with the entry, nothing written.
	b.publish(t, queue, amqp.Publishing{Body: first})
	waitFor(t, "the late copy", 30*time.Second, run, contains(run, `applied order=o-late token=1 wrote=false$`))
	waitFor(t, "the late copy's ack", 30*time.Second, run, func() bool {
		return len(matching(run, `done order=o-late replayed=false wrote=(true|false) token=1$`)) == 2
	})
	if got := matching(run, `done order=o-late `); got[1] != fmt.Sprintf("consumer[%d] done order=o-late replayed=false wrote=false token=1", run.cmd.Process.Pid) {
		t.Errorf("the late copy: %q, want acked without writing", got[1])
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	record, err := client.Get(ctx, namespace, key)
	if err != nil {
		t.Fatal(err)
	}
	var receipt Entry
	if record.State != idempotency.StateCompleted || record.FencingToken != 1 || json.Unmarshal(record.Response, &receipt) != nil || receipt != want {
		t.Errorf("record after the late copy: %s token %d %s, want COMPLETED under token 1 with %+v", record.State, record.FencingToken, record.Response, want)
	}
	waitReaped()

	// (b) Another body under the same order id, twice.
	other := body("o-late", 999)
	b.publish(t, queue, amqp.Publishing{Body: other}, amqp.Publishing{Body: other})
	waitFor(t, "both other-body copies parked", 30*time.Second, run, func() bool {
		return len(matching(run, `park order=o-late reason=conflicts_with_applied_order`)) == 2
	})
	ledger, _ := OpenLedger(ledgerDir)
	entries, err := ledger.Entries()
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 1 || entries["o-late"] != want {
		t.Errorf("ledger: %+v, want only %+v", entries, want)
	}
	if got := strings.Join(appliedLog(t, ledgerDir)["o-late"], " "); got != "1" {
		t.Errorf("the effect of o-late was written under tokens [%s], want [1]", got)
	}
	parked := b.drain(t, ParkingQueue(queue))
	if len(parked) != 2 {
		t.Fatalf("%d parked messages, want 2", len(parked))
	}
	for _, d := range parked {
		if string(d.Body) != string(other) || d.Headers[headerParkedReason] != "conflicts_with_applied_order" ||
			!strings.Contains(fmt.Sprint(d.Headers[headerParkedDetail]), "500 cents under token 1") {
			t.Errorf("parked: %s %v, want the other body as conflicts_with_applied_order", d.Body, d.Headers)
		}
	}
	for _, name := range QueueNames(queue, testRetryDelays)[2:] {
		if n := b.depth(t, name); n != 0 {
			t.Errorf("%s holds %d messages, want 0", name, n)
		}
	}
}

// Issue 26, defect 4. The ledger is gone (its folder replaced by a file)
// while an order arrives: every attempt fails, the retries wait 200 ms then
// 400 ms in the retry queues, and when the budget is spent the order is
// parked as retries_exhausted, nothing applied. Once the ledger is back, the
// operator moves it back into the queue: applied once.
// Issue 33, defect 14: the ledger's entry is durable before the message is
// acked. The consumer runs under strace (its system calls: fsync, rename);
// an order is applied and acked, then the consumer is killed with SIGKILL.
// The entry's bytes were fsynced before the rename that made them the
// entry, the folder fsynced after it (so the name survives a crash of the
// machine, which a kill -9 alone cannot show), and applied.log fsynced; the
// entry is whole after the kill.
func TestLedgerEntryIsSyncedBeforeTheAck(t *testing.T) {
	strace, err := exec.LookPath("strace")
	if err != nil {
		t.Fatal("strace is not installed (run-tests.sh installs it)")
	}
	server := idempotencytest.Start(t)
	dir := t.TempDir()
	ledgerDir := filepath.Join(dir, "ledger")
	trace := filepath.Join(dir, "strace.out")
	queue := "idempotency-go-example-" + randomSuffix(t)
	b := dialBroker(t, amqpURL())
	b.declareTopology(t, queue)
	run := startConsumerUnder(t, dir, 1,
		[]string{strace, "-f", "-qq", "-y", "-e", "trace=fsync,fdatasync,rename,renameat,renameat2", "-o", trace},
		consumerArgs(queue, server.Target, "examples/rabbitmq-go/"+queue, ledgerDir)...)
	defer func() { t.Logf("consumer:\n%s", strings.Join(run.lines(), "\n")) }()
	b.publish(t, queue, amqp.Publishing{Body: body("o-sync", 321)})
	waitFor(t, "the order acked", 30*time.Second, run, contains(run, `done order=o-sync replayed=false wrote=true token=1$`))
	// kill -9 the consumer (its pid is in its log lines); strace exits with it.
	pid := regexp.MustCompile(`consumer\[(\d+)\] done order=o-sync`).FindStringSubmatch(strings.Join(run.lines(), "\n"))
	if pid == nil {
		t.Fatal("no pid in the consumer's log")
	}
	var consumerPid int
	fmt.Sscan(pid[1], &consumerPid)
	if err := syscall.Kill(consumerPid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case <-run.exited:
	case <-time.After(10 * time.Second):
		t.Fatal("strace did not exit within 10 s of the consumer's SIGKILL")
	}

	data, err := os.ReadFile(trace)
	if err != nil {
		t.Fatal(err)
	}
	entry := regexp.QuoteMeta(filepath.Join(ledgerDir, "order-o-sync.json"))
	steps := []struct{ what, pattern string }{
		{"fsync of the new entry's file", `fsync\(\d+<` + entry + `\.tmp>\)\s+= 0`},
		{"its rename into place", `rename(at2?)?\(.*"` + entry + `\.tmp",.*"` + entry + `"`},
		{"fsync of the ledger's folder", `fsync\(\d+<` + regexp.QuoteMeta(ledgerDir) + `>\)\s+= 0`},
		{"fsync of applied.log", `fsync\(\d+<` + regexp.QuoteMeta(filepath.Join(ledgerDir, "applied.log")) + `>\)\s+= 0`},
	}
	lines := strings.Split(string(data), "\n")
	at := 0
	for _, step := range steps {
		re := regexp.MustCompile(step.pattern)
		for at < len(lines) && !re.MatchString(lines[at]) {
			at++
		}
		if at == len(lines) {
			t.Fatalf("no %s (in order) in the consumer's system calls:\n%s", step.what, data)
		}
	}
	ledger, _ := OpenLedger(ledgerDir)
	if got, ok, err := ledger.Lookup("o-sync"); err != nil || !ok || got.AmountCents != 321 || got.FencingToken != 1 {
		t.Errorf("the entry after the kill: %+v %t %v", got, ok, err)
	}
}

// Issue 33, defect 3: the retry copy is published mandatory. The first retry
// queue is deleted (by hand, say) and the ledger fails, so the order's retry
// copy is routed nowhere: RabbitMQ returns it, the publisher reports it, and
// the delivery is rejected back instead of acked, until the delivery limit
// (5) parks it: nothing lost. (Published without mandatory, the copy was
// dropped silently and the delivery acked: the order was gone.)
func TestUnroutableRetryCopyIsNotLost(t *testing.T) {
	server := idempotencytest.Start(t)
	dir := t.TempDir()
	ledgerDir := filepath.Join(dir, "ledger")
	queue := "idempotency-go-example-" + randomSuffix(t)
	b := dialBroker(t, amqpURL())
	b.declareTopology(t, queue)
	run := startConsumer(t, dir, 1, consumerArgs(queue, server.Target, "examples/rabbitmq-go/"+queue, ledgerDir)...)
	defer func() { t.Logf("consumer:\n%s", strings.Join(run.lines(), "\n")) }()
	waitFor(t, "the consumer to start", 30*time.Second, run, contains(run, `ready queue=`))
	if _, err := b.ch.QueueDelete(RetryQueue(queue, testRetryDelays[0]), false, false, false); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(ledgerDir, ledgerDir+".offline"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(ledgerDir, []byte("not a folder"), 0o644); err != nil {
		t.Fatal(err)
	}
	order := body("o-unroutable", 555)
	b.publish(t, queue, amqp.Publishing{Body: order})
	deadline := time.Now().Add(15 * time.Second)
	for b.depth(t, ParkingQueue(queue)) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the order is not in the parking queue after 15 s (main queue: %d messages): its retry copy was dropped", b.depth(t, queue))
		}
		time.Sleep(50 * time.Millisecond)
	}
	parked := b.drain(t, ParkingQueue(queue))
	if len(parked) != 1 || string(parked[0].Body) != string(order) || parked[0].Headers["x-first-death-reason"] != "delivery_limit" {
		t.Fatalf("parked: %d messages, want the order dead-lettered by delivery_limit", len(parked))
	}
	if got := matching(run, `no queue took the copy for `+regexp.QuoteMeta(RetryQueue(queue, testRetryDelays[0]))); len(got) != testDeliveryLimit+1 {
		t.Errorf("%d returned copies, want %d (one per delivery):\n%s", len(got), testDeliveryLimit+1, strings.Join(run.lines(), "\n"))
	}
}

func TestLedgerOutageLongerThanTheRetryBudgetIsParked(t *testing.T) {
	server := idempotencytest.Start(t)
	client := server.Client(t)
	dir := t.TempDir()
	ledgerDir := filepath.Join(dir, "ledger")
	queue := "idempotency-go-example-" + randomSuffix(t)
	namespace := "examples/rabbitmq-go/" + queue
	b := dialBroker(t, amqpURL())
	b.declareTopology(t, queue)
	run := startConsumer(t, dir, 1, consumerArgs(queue, server.Target, namespace, ledgerDir)...)
	defer func() { t.Logf("consumer:\n%s", strings.Join(run.lines(), "\n")) }()
	waitFor(t, "the consumer to start", 30*time.Second, run, contains(run, `ready queue=`))

	if err := os.Rename(ledgerDir, ledgerDir+".offline"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(ledgerDir, []byte("not a folder"), 0o644); err != nil {
		t.Fatal(err)
	}
	order := body("o-out", 777)
	b.publish(t, queue, amqp.Publishing{Body: order})
	waitFor(t, "the order parked", 30*time.Second, run, contains(run, `park order=o-out reason=retries_exhausted`))
	retries := matching(run, `retry order=o-out attempt=\d queue=\S+`)
	if len(retries) != 2 || !strings.Contains(retries[0], "attempt=1 queue="+RetryQueue(queue, testRetryDelays[0])) ||
		!strings.Contains(retries[1], "attempt=2 queue="+RetryQueue(queue, testRetryDelays[1])) {
		t.Errorf("retries: %q, want attempts 1 and 2 through the 200ms and 400ms queues", retries)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	record, err := client.Get(ctx, namespace, idempotency.MustDeriveKey("examples/rabbitmq-go", "order", "o-out"))
	if err != nil {
		t.Fatal(err)
	}
	if record.State != idempotency.StateReleased || record.FencingToken != 3 {
		t.Errorf("record: %s token %d, want RELEASED after three attempts", record.State, record.FencingToken)
	}
	// The consumer logs "park" before its copy is confirmed: wait for the copy.
	waitFor(t, "the parked copy in the parking queue", 10*time.Second, run, func() bool { return b.depth(t, ParkingQueue(queue)) == 1 })
	parked := b.drain(t, ParkingQueue(queue))
	if len(parked) != 1 || string(parked[0].Body) != string(order) || parked[0].Headers[headerParkedReason] != "retries_exhausted" {
		t.Fatalf("parked: %v, want the order as retries_exhausted", parked)
	}

	// The operator: the ledger is back; the order goes back into the queue.
	if err := os.Remove(ledgerDir); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(ledgerDir+".offline", ledgerDir); err != nil {
		t.Fatal(err)
	}
	b.publish(t, queue, amqp.Publishing{Body: parked[0].Body, MessageId: parked[0].MessageId})
	waitFor(t, "the order applied", 30*time.Second, run, contains(run, `done order=o-out replayed=false wrote=true token=4$`))
	ledger, _ := OpenLedger(ledgerDir)
	entries, err := ledger.Entries()
	if err != nil {
		t.Fatal(err)
	}
	if want := (Entry{OrderID: "o-out", AmountCents: 777, FencingToken: 4, BodySHA256: sha(order)}); len(entries) != 1 || entries["o-out"] != want {
		t.Errorf("ledger: %+v, want only %+v", entries, want)
	}
	for _, name := range QueueNames(queue, testRetryDelays) {
		if n := b.depth(t, name); n != 0 {
			t.Errorf("%s holds %d messages, want 0", name, n)
		}
	}
}

// Issue 26, defect 5, on the shared broker: the consumer starts against the
// queues as the recipe declares them, which exist already (the old consumer
// declared a non-durable classic queue, which RabbitMQ refused there), and
// the broker holds the main queue as durable and quorum: declaring it as
// not durable, or as classic, is refused with PRECONDITION_FAILED.
func TestQueueIsDurableQuorumAndDeclaresAgainstAnExistingOne(t *testing.T) {
	server := idempotencytest.Start(t)
	dir := t.TempDir()
	queue := "idempotency-go-example-" + randomSuffix(t)
	b := dialBroker(t, amqpURL())
	b.declareTopology(t, queue)
	run := startConsumer(t, dir, 1, consumerArgs(queue, server.Target, "examples/rabbitmq-go/"+queue, filepath.Join(dir, "ledger"))...)
	defer func() { t.Logf("consumer:\n%s", strings.Join(run.lines(), "\n")) }()
	b.publish(t, queue, amqp.Publishing{Body: body("o-decl", 5)})
	waitFor(t, "the order", 30*time.Second, run, contains(run, `done order=o-decl replayed=false wrote=true token=1$`))

	for _, c := range []struct {
		durable bool
		args    amqp.Table
		want    string
	}{
		{false, MainQueueArgs(queue, testDeliveryLimit), "inequivalent arg 'durable'"},
		{true, classicArgs(queue), "inequivalent arg 'x-queue-type'"},
	} {
		ch, err := b.conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		_, err = ch.QueueDeclare(queue, c.durable, false, false, false, c.args)
		var amqpErr *amqp.Error
		if !errors.As(err, &amqpErr) || amqpErr.Code != amqp.PreconditionFailed || !strings.Contains(amqpErr.Reason, c.want) {
			t.Errorf("declare %s durable=%t %v: %v, want PRECONDITION_FAILED (%s)", queue, c.durable, c.args, err, c.want)
		}
	}
}

// classicArgs are the main queue's arguments but for its type.
func classicArgs(queue string) amqp.Table {
	args := MainQueueArgs(queue, testDeliveryLimit)
	args["x-queue-type"] = "classic"
	return args
}

// privateRabbit is a RabbitMQ node of the test's own (its own node name,
// ports, data folder; no plugins), so that it can be restarted without
// touching the machine's broker.
type privateRabbit struct {
	t          *testing.T
	dir, name  string
	port, dist int
	cmd        *exec.Cmd
	exited     chan struct{}
}

func rabbitServerBin() string {
	if bin := os.Getenv("RABBITMQ_SERVER_BIN"); bin != "" {
		return bin
	}
	return "/usr/lib/rabbitmq/bin/rabbitmq-server" // Debian's, without the wrapper that switches user
}

func startPrivateRabbit(t *testing.T) *privateRabbit {
	t.Helper()
	bin := rabbitServerBin()
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("the broker restart test runs a RabbitMQ node of its own: %s not found (install Debian's rabbitmq-server, or set RABBITMQ_SERVER_BIN): %v", bin, err)
	}
	port, err := idempotencytest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	dist, err := idempotencytest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	r := &privateRabbit{t: t, dir: t.TempDir(), name: fmt.Sprintf("idempotency-test-%d@localhost", port), port: port, dist: dist}
	if err := os.WriteFile(filepath.Join(r.dir, "enabled_plugins"), []byte("[].\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(r.dir, "rabbitmq-env.conf"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	r.start()
	t.Cleanup(r.stop)
	return r
}

func (r *privateRabbit) url() string { return fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", r.port) }

func (r *privateRabbit) start() {
	r.t.Helper()
	logFile, err := os.OpenFile(filepath.Join(r.dir, "node.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		r.t.Fatal(err)
	}
	defer logFile.Close()
	cmd := exec.Command(rabbitServerBin())
	cmd.Env = append(os.Environ(),
		"HOME="+r.dir, // its own Erlang cookie
		"RABBITMQ_CONF_ENV_FILE="+filepath.Join(r.dir, "rabbitmq-env.conf"),
		"RABBITMQ_NODENAME="+r.name,
		"RABBITMQ_NODE_IP_ADDRESS=127.0.0.1",
		fmt.Sprintf("RABBITMQ_NODE_PORT=%d", r.port),
		fmt.Sprintf("RABBITMQ_DIST_PORT=%d", r.dist),
		"RABBITMQ_MNESIA_BASE="+filepath.Join(r.dir, "mnesia"),
		"RABBITMQ_LOG_BASE="+filepath.Join(r.dir, "log"),
		"RABBITMQ_ENABLED_PLUGINS_FILE="+filepath.Join(r.dir, "enabled_plugins"),
		"RABBITMQ_CONFIG_FILE="+filepath.Join(r.dir, "rabbitmq"),
		"RABBITMQ_ADVANCED_CONFIG_FILE="+filepath.Join(r.dir, "advanced.config"),
		"RABBITMQ_PID_FILE="+filepath.Join(r.dir, "pid"),
		"ERL_EPMD_ADDRESS=127.0.0.1",
	)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // its Erlang processes in one group
	if err := cmd.Start(); err != nil {
		r.t.Fatal(err)
	}
	r.cmd, r.exited = cmd, make(chan struct{})
	go func(exited chan struct{}) { _ = cmd.Wait(); close(exited) }(r.exited)
	deadline := time.Now().Add(90 * time.Second)
	for {
		if conn, err := amqp.Dial(r.url()); err == nil {
			conn.Close()
			return
		}
		select {
		case <-r.exited:
			r.t.Fatalf("the private RabbitMQ node exited:\n%s", r.log())
		default:
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("the private RabbitMQ node did not accept connections within 90 s:\n%s", r.log())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// stop stops the node as a service manager does (SIGTERM: RabbitMQ shuts
// down cleanly), SIGKILLs its process group after 60 s.
func (r *privateRabbit) stop() {
	if r.cmd == nil {
		return
	}
	select {
	case <-r.exited:
	default:
		_ = syscall.Kill(-r.cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-r.exited:
		case <-time.After(60 * time.Second):
			_ = syscall.Kill(-r.cmd.Process.Pid, syscall.SIGKILL)
			<-r.exited
		}
	}
	r.cmd = nil
}

// ctl runs rabbitmqctl against the node (its name, its cookie in HOME).
func (r *privateRabbit) ctl(args ...string) {
	r.t.Helper()
	cmd := exec.Command(filepath.Join(filepath.Dir(rabbitServerBin()), "rabbitmqctl"), append([]string{"-n", r.name}, args...)...)
	cmd.Env = append(os.Environ(), "HOME="+r.dir, "ERL_EPMD_ADDRESS=127.0.0.1")
	if out, err := cmd.CombinedOutput(); err != nil {
		r.t.Fatalf("rabbitmqctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

func (r *privateRabbit) log() string {
	data, _ := os.ReadFile(filepath.Join(r.dir, "node.log"))
	return string(data)
}

// Issue 26, defect 5, for real: on a RabbitMQ node of the test's own, the
// consumer declares its queues and stops; an order is published; the node is
// stopped and started again; the order is still there, and the consumer
// applies it. (The old consumer's non-durable queue was gone after the
// restart, and the order with it.)
//
// Issue 33, defect 5: dead-lettering is at least once. Before the restart a
// message is given back past the delivery limit while the parking queue is
// missing (deleted by the test): RabbitMQ keeps it instead of dropping it.
// The parking queue is declared again, the node restarted, and the message
// is in the parking queue, x-death saying delivery_limit. (At most once, the
// default, dropped it.)
func TestOrderSurvivesABrokerRestart(t *testing.T) {
	server := idempotencytest.Start(t)
	node := startPrivateRabbit(t)
	dir := t.TempDir()
	queue := "orders-restart"
	args := []string{"-amqp", node.url(), "-queue", queue, "-target", server.Target,
		"-namespace", "examples/rabbitmq-go/restart", "-ledger", filepath.Join(dir, "ledger"), "-lease", "2s", "-wait", "7s",
		"-delivery-limit", "2"}

	first := startConsumer(t, dir, 1, args...)
	waitFor(t, "the consumer to declare its queues", 30*time.Second, first, contains(first, `ready queue=orders-restart$`))
	first.signal(syscall.SIGTERM)

	b := dialBroker(t, node.url())
	// A poison message given back 3 times (limit 2) while the parking queue is missing.
	if _, err := b.ch.QueueDelete(ParkingQueue(queue), false, false, false); err != nil {
		t.Fatal(err)
	}
	poison := []byte(`{"order_id":"o-poison","amount_cents":1}`)
	b.publish(t, queue, amqp.Publishing{Body: poison})
	for returns := 0; returns < 3; {
		d, ok, err := b.ch.Get(queue, false)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			t.Fatalf("the poison message left the queue after %d returns, want 3", returns)
		}
		if err := d.Reject(true); err != nil {
			t.Fatal(err)
		}
		returns++
	}
	if _, err := b.ch.QueueDeclare(ParkingQueue(queue), true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatal(err)
	}
	order := body("o-restart", 4242)
	b.publish(t, queue, amqp.Publishing{Body: order})
	b.conn.Close()

	node.stop()
	node.start()

	b = dialBroker(t, node.url())
	deadline := time.Now().Add(30 * time.Second)
	for b.depth(t, ParkingQueue(queue)) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the message dead-lettered while the parking queue was missing is not in it 30 s after the restart: dead-lettering dropped it")
		}
		time.Sleep(100 * time.Millisecond)
	}
	parked := b.drain(t, ParkingQueue(queue))
	if len(parked) != 1 || string(parked[0].Body) != string(poison) || parked[0].Headers["x-first-death-reason"] != "delivery_limit" {
		t.Fatalf("the parking queue after the restart: %d messages, want the poison message dead-lettered by delivery_limit", len(parked))
	}

	second := startConsumer(t, dir, 2, args...)
	defer func() { t.Logf("consumer:\n%s", strings.Join(second.lines(), "\n")) }()
	waitFor(t, "the order, after the restart", 30*time.Second, second, contains(second, `done order=o-restart replayed=false wrote=true token=1$`))
	second.signal(syscall.SIGTERM)
}

// Issue 33, defect 3: after a confirm timeout the publisher opens a new
// channel. On a RabbitMQ node of the test's own, the consumer (confirms
// awaited 1 s) holds an order whose effect fails just before publishing its
// retry copy; the test raises a memory alarm (vm_memory_high_watermark 0:
// the broker stops reading from publishing connections), lets the consumer
// publish (no confirm: the timeout), and clears the alarm. The next copies go
// out on a new channel, so the order goes round the retry queues and is
// parked as retries_exhausted. (Kept on the closed channel, every later copy
// failed at once, each delivery was given back at once, and the order was
// dead-lettered by the delivery limit within milliseconds: a storm.)
func TestPublisherReopensAfterAConfirmTimeout(t *testing.T) {
	server := idempotencytest.Start(t)
	node := startPrivateRabbit(t)
	dir := t.TempDir()
	ledgerDir := filepath.Join(dir, "ledger")
	queue := "orders-confirm"
	run := startConsumer(t, dir, 1, "-amqp", node.url(), "-queue", queue, "-target", server.Target,
		"-namespace", "examples/rabbitmq-go/confirm", "-ledger", ledgerDir, "-lease", "2s", "-wait", "7s",
		"-retry-delays", testRetryDelaysFlag, "-delivery-limit", testDeliveryLimitArg,
		"-confirm-timeout", "1s", "-hold", "o-conf@republish")
	defer func() { t.Logf("consumer:\n%s", strings.Join(run.lines(), "\n")) }()
	waitFor(t, "the consumer to start", 30*time.Second, run, contains(run, `ready queue=`))
	if err := os.Rename(ledgerDir, ledgerDir+".offline"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(ledgerDir, []byte("not a folder"), 0o644); err != nil {
		t.Fatal(err)
	}
	b := dialBroker(t, node.url())
	b.publish(t, queue, amqp.Publishing{Body: body("o-conf", 99)})
	waitFor(t, "the consumer holding before its retry copy", 30*time.Second, run, contains(run, `holding order=o-conf at=republish$`))

	node.ctl("set_vm_memory_high_watermark", "0")
	if err := run.cmd.Process.Signal(syscall.SIGUSR1); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the confirm timeout", 30*time.Second, run, contains(run, `no confirm from the broker for \S+ within 1s`))
	node.ctl("set_vm_memory_high_watermark", "0.4")

	waitFor(t, "the order parked as retries_exhausted", 30*time.Second, run, func() bool {
		return contains(run, `park order=o-conf reason=retries_exhausted`)() || b.depth(t, ParkingQueue(queue)) > 0 &&
			!contains(run, `park order=o-conf`)()
	})
	if !contains(run, `publisher: a new channel$`)() {
		t.Error("no new channel after the confirm timeout")
	}
	if got := matching(run, `requeueing the delivery`); len(got) > 1 {
		t.Errorf("%d deliveries given back for a failed publish, want at most 1 (the timed-out copy's):\n%s", len(got), strings.Join(got, "\n"))
	}
	waitFor(t, "the parked copy", 10*time.Second, run, func() bool { return b.depth(t, ParkingQueue(queue)) > 0 })
	for _, d := range b.drain(t, ParkingQueue(queue)) {
		if d.Headers[headerParkedReason] != "retries_exhausted" {
			t.Errorf("parked: %v, want retries_exhausted (not the delivery limit)", d.Headers)
		}
	}
}
