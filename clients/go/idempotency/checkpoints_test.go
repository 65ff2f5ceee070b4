package idempotency_test

// Checkpoints: progress saved under a lease, handed to whoever takes the key
// over, shown by Get, discarded by Complete; and Once resuming from them,
// including a worker process killed between two steps and resumed by another.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	pb "idempotencyservice/gen/idempotencyv1"
	"idempotencyservice/idempotency"
	"idempotencyservice/idempotency/idempotencytest"
)

func TestACheckpointSavedWithExtendLeaseGoesToTheNextHolderAfterARelease(t *testing.T) {
	onEachStore(t, func(t *testing.T, server *idempotencytest.Server) {
		c, ns, ctx := server.Client(t), namespace(t), ctx(t)
		first, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{})
		if err != nil || first.Checkpoint != nil || first.CheckpointFencingToken != 0 || first.Retried {
			t.Fatalf("%+v %v", first, err)
		}
		if _, err := c.ExtendLeaseWithCheckpoint(ctx, ns, "k", first.LeaseToken, 0, []byte("step 1")); err != nil {
			t.Fatal(err)
		}
		checkRecord(t, c, ns, "k", idempotency.StateInProgress, "step 1", 1)
		if _, err := c.ExtendLease(ctx, ns, "k", first.LeaseToken, 0); err != nil { // no checkpoint: kept
			t.Fatal(err)
		}
		checkRecord(t, c, ns, "k", idempotency.StateInProgress, "step 1", 1)
		if err := c.ReleaseWithCheckpoint(ctx, ns, "k", first.LeaseToken, []byte("step 2")); err != nil {
			t.Fatal(err)
		}
		checkRecord(t, c, ns, "k", idempotency.StateReleased, "step 2", 1)

		second, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{})
		if err != nil || second.FencingToken != 2 || string(second.Checkpoint) != "step 2" || second.CheckpointFencingToken != 1 {
			t.Fatalf("the next holder: %+v %v", second, err)
		}
		if _, err := c.Complete(ctx, ns, "k", second.LeaseToken, []byte("done"), 0); err != nil {
			t.Fatal(err)
		}
		record, err := c.Get(ctx, ns, "k")
		if err != nil || record.State != idempotency.StateCompleted || record.Checkpoint != nil || record.CheckpointFencingToken != 0 {
			t.Fatalf("after Complete: %+v %v, want no checkpoint", record, err)
		}
	})
}

func checkRecord(t *testing.T, c *idempotency.Client, ns, key string, state idempotency.State, checkpoint string, fencing uint64) {
	t.Helper()
	record, err := c.Get(context.Background(), ns, key)
	if err != nil || record.State != state || string(record.Checkpoint) != checkpoint || record.CheckpointFencingToken != fencing {
		t.Fatalf("%+v %v: want %s with checkpoint %q saved under %d", record, err, state, checkpoint, fencing)
	}
}

func TestALeaseThatRunsOutHandsItsCheckpointToTheNextClaim(t *testing.T) {
	c, ns, ctx := client(t), namespace(t), ctx(t)
	first, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{LeaseTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.ExtendLeaseWithCheckpoint(ctx, ns, "k", first.LeaseToken, time.Second, []byte{}); err != nil { // an empty one
		t.Fatal(err)
	}
	var taken *idempotency.ClaimResult
	until(t, 5*time.Second, "the lease to run out", func() bool {
		claim, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{})
		if err != nil {
			t.Fatal(err)
		}
		taken = claim
		return claim.Claimed()
	})
	if taken.FencingToken != 2 || taken.Checkpoint == nil || len(taken.Checkpoint) != 0 || taken.CheckpointFencingToken != 1 {
		t.Fatalf("%+v: want an empty (not absent) checkpoint saved under 1", taken)
	}
}

func TestACheckpointOverTheLimitIsRefused(t *testing.T) {
	c, ns, ctx := client(t), namespace(t), ctx(t)
	claim, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.ExtendLeaseWithCheckpoint(ctx, ns, "k", claim.LeaseToken, 0, make([]byte, 64*1024+1))
	if !errors.Is(err, idempotency.ErrInvalidArgument) || !strings.Contains(err.Error(), "checkpoint") {
		t.Fatalf("got %v, want INVALID_ARGUMENT naming checkpoint", err)
	}
	if _, err := c.ExtendLeaseWithCheckpoint(ctx, ns, "k", claim.LeaseToken, 0, make([]byte, 64*1024)); err != nil {
		t.Fatal(err)
	}
}

// job is three steps with a checkpoint after each; it fails once after failAfter.
type job struct {
	log       []string
	failAfter string
	seen      []string // what each run was handed: "checkpoint@fencing"
}

func (j *job) run(ctx context.Context, lease idempotency.Lease) ([]byte, error) {
	j.seen = append(j.seen, fmt.Sprintf("%s@%d", lease.Checkpoint(), lease.CheckpointFencingToken()))
	var done []string
	if lease.Checkpoint() != nil {
		if err := json.Unmarshal(lease.Checkpoint(), &done); err != nil {
			return nil, err
		}
	}
	for _, step := range []string{"reserve", "charge", "email"} {
		if contains(done, step) {
			continue
		}
		j.log = append(j.log, step)
		done = append(done, step)
		checkpoint, _ := json.Marshal(done)
		if err := lease.SaveCheckpoint(ctx, checkpoint); err != nil {
			return nil, err
		}
		if !bytes.Equal(lease.Checkpoint(), checkpoint) || lease.CheckpointFencingToken() != lease.FencingToken {
			return nil, fmt.Errorf("after SaveCheckpoint the lease shows %s@%d", lease.Checkpoint(), lease.CheckpointFencingToken())
		}
		if step == j.failAfter {
			j.failAfter = ""
			return nil, fmt.Errorf("failed after %s", step)
		}
	}
	return json.Marshal(done)
}

func contains(list []string, s string) bool {
	for _, item := range list {
		if item == s {
			return true
		}
	}
	return false
}

func TestOnceResumesAFailedAttemptFromItsCheckpoint(t *testing.T) {
	onEachStore(t, func(t *testing.T, server *idempotencytest.Server) {
		c, ns, ctx := server.Client(t), namespace(t), ctx(t)
		j := &job{failAfter: "charge"}
		if _, err := c.Once(ctx, ns, "order-1", j.run); err == nil || err.Error() != "failed after charge" {
			t.Fatalf("got %v, want the work's error", err)
		}
		checkRecord(t, c, ns, "order-1", idempotency.StateReleased, `["reserve","charge"]`, 1)

		r, err := c.Once(ctx, ns, "order-1", j.run)
		if err != nil || string(r.Value) != `["reserve","charge","email"]` {
			t.Fatalf("%+v %v", r, err)
		}
		if fmt.Sprint(j.log) != "[reserve charge email]" {
			t.Fatalf("steps done %v, want each once", j.log)
		}
		if fmt.Sprint(j.seen) != `[@0 ["reserve","charge"]@1]` {
			t.Fatalf("the runs were handed %v", j.seen)
		}
		if record, err := c.Get(ctx, ns, "order-1"); err != nil || record.Checkpoint != nil {
			t.Fatalf("%+v %v: Complete discards the checkpoint", record, err)
		}
	})
}

func TestAReleaseAfterAFailureCarriesTheCheckpointWhoseSaveFailed(t *testing.T) {
	rec := newRecorder()
	rec.fail["ExtendLease"] = true
	c, ns, ctx := dial(t, []string{sqlite(t).Target}, rec), namespace(t), ctx(t)
	c.Retry = idempotency.RetryPolicy{MaxAttempts: 2, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 10 * time.Millisecond}
	_, err := c.Once(ctx, ns, "k", func(ctx context.Context, lease idempotency.Lease) ([]byte, error) {
		return nil, lease.SaveCheckpoint(ctx, []byte("step 1 done"))
	}, idempotency.WithoutHeartbeat())
	if !errors.Is(err, idempotency.ErrUnavailable) {
		t.Fatalf("got %v, want the save's UNAVAILABLE", err)
	}
	if n := rec.count("ExtendLease"); n != 2 {
		t.Fatalf("%d ExtendLease attempts, want 2", n)
	}
	checkRecord(t, c, ns, "k", idempotency.StateReleased, "step 1 done", 1)
}

func TestSavingACheckpointOnALostLeaseIsLeaseLost(t *testing.T) {
	c, ns, ctx := client(t), namespace(t), ctx(t)
	var saveErr error
	cancelled := false
	_, err := c.Once(ctx, ns, "k", func(work context.Context, lease idempotency.Lease) ([]byte, error) {
		if _, err := c.Stub().Purge(ctx, &pb.PurgeRequest{Namespace: ns, Key: "k", Reason: "go test"}); err != nil {
			return nil, err
		}
		saveErr = lease.SaveCheckpoint(work, []byte("too late"))
		cancelled = work.Err() != nil
		return []byte("not stored"), nil
	}, idempotency.WithoutHeartbeat())
	var lost *idempotency.LeaseLostError
	if !errors.As(saveErr, &lost) || !errors.Is(saveErr, idempotency.ErrNotFound) || lost.When != "while saving a checkpoint" {
		t.Fatalf("SaveCheckpoint: %v, want a *LeaseLostError caused by NOT_FOUND", saveErr)
	}
	if !cancelled {
		t.Error("the work's context was not cancelled")
	}
	if !errors.Is(err, idempotency.ErrLeaseLost) {
		t.Fatalf("Once: %v, want ErrLeaseLost", err)
	}
	if record, err := c.Get(ctx, ns, "k"); err != nil || record.State != idempotency.StateAbsent {
		t.Fatalf("%+v %v, want ABSENT", record, err)
	}
	if err := (idempotency.Lease{}).SaveCheckpoint(ctx, nil); err == nil {
		t.Error("SaveCheckpoint on a Lease Once did not hand out: no error")
	}
}

// --- a worker killed between two steps -------------------------------------

// workerEnv makes the test binary a worker process (TestMain): a three-step
// job that survives its worker being killed between steps and does each
// step once, the "Resumable work" example of docs/clients.md in Go.
const workerEnv = "IDEMPOTENCY_GO_TEST_WORKER"

type workerArgs struct {
	Target, Namespace, JobID, Log string
	LeaseTTL                      time.Duration
	DieAfter                      string
}

// workerMain runs the job of $IDEMPOTENCY_GO_TEST_WORKER (JSON workerArgs)
// and prints its result as JSON; it kills itself (SIGKILL) right after the
// checkpoint of step DieAfter is saved.
func workerMain() int {
	var args workerArgs
	if err := json.Unmarshal([]byte(os.Getenv(workerEnv)), &args); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	c, err := idempotency.Dial(args.Target)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	done, _, err := idempotency.OnceJSON(ctx, c, args.Namespace, args.JobID, func(ctx context.Context, lease idempotency.Lease) ([]string, error) {
		// lease.Checkpoint(): what the last worker saved (nil the first time).
		var done []string
		if lease.Checkpoint() != nil {
			if err := json.Unmarshal(lease.Checkpoint(), &done); err != nil {
				return nil, err
			}
		}
		for _, step := range []string{"reserve", "charge", "email"} {
			if contains(done, step) {
				continue
			}
			if err := doStep(args.Log, step, args.JobID, lease.FencingToken); err != nil {
				return nil, err
			}
			done = append(done, step)
			checkpoint, _ := json.Marshal(done)
			if err := lease.SaveCheckpoint(ctx, checkpoint); err != nil {
				return nil, err
			}
			if step == args.DieAfter {
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL) // the worker dies between two steps
				select {}
			}
		}
		return done, nil
	}, idempotency.WithLeaseTTL(args.LeaseTTL), idempotency.WaitOnInProgress(60*time.Second))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	out, _ := json.Marshal(done)
	fmt.Println(string(out))
	return 0
}

// doStep is the step's effect: a line in the log, on disk before the checkpoint.
func doStep(path, step, jobID string, fencingToken uint64) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := fmt.Fprintf(f, "%s %s pid=%d fencing=%d\n", step, jobID, os.Getpid(), fencingToken); err != nil {
		return err
	}
	return f.Sync()
}

// runWorker runs the job in a new process: its exit, its stdout.
func runWorker(t *testing.T, args workerArgs) (*os.ProcessState, string) {
	t.Helper()
	env, _ := json.Marshal(args)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), workerEnv+"="+string(env))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("worker: %v", err)
	}
	timer := time.AfterFunc(90*time.Second, func() { _ = cmd.Process.Kill() })
	defer timer.Stop()
	err := cmd.Wait()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("worker: %v", err)
	}
	if stderr.Len() > 0 {
		t.Logf("worker stderr: %s", stderr.String())
	}
	return cmd.ProcessState, strings.TrimSpace(stdout.String())
}

func TestAWorkerKilledAfterItsSecondStepIsResumedFromItsCheckpointByAnother(t *testing.T) {
	onEachStore(t, func(t *testing.T, server *idempotencytest.Server) {
		ns, log := namespace(t), filepath.Join(t.TempDir(), "steps.log")
		args := workerArgs{Target: server.Target, Namespace: ns, JobID: "job-1", Log: log, LeaseTTL: time.Second, DieAfter: "charge"}
		killed, _ := runWorker(t, args)
		if ws, ok := killed.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
			t.Fatalf("the first worker: %v, want killed by SIGKILL after step 2", killed)
		}
		if steps := stepsDone(t, log); fmt.Sprint(column(steps, 0)) != "[reserve charge]" {
			t.Fatalf("steps before the kill: %v", steps)
		}
		c, ctx := server.Client(t), ctx(t)
		record, err := c.Get(ctx, ns, "job-1")
		if err != nil || record.State != idempotency.StateInProgress || string(record.Checkpoint) != `["reserve","charge"]` {
			t.Fatalf("%+v %v: want the dead worker's lease with its checkpoint", record, err)
		}

		args.DieAfter = ""
		resumed, out := runWorker(t, args)
		if !resumed.Success() || out != `["reserve","charge","email"]` {
			t.Fatalf("the second worker: %v, printed %q", resumed, out)
		}
		steps := stepsDone(t, log)
		if fmt.Sprint(column(steps, 0)) != "[reserve charge email]" { // each step once
			t.Fatalf("steps: %v", steps)
		}
		if pids := column(steps, 2); pids[0] != pids[1] || pids[1] == pids[2] {
			t.Fatalf("steps by %v: want the first two by the killed worker, the last by the other", pids)
		}
		if fmt.Sprint(column(steps, 3)) != "[fencing=1 fencing=1 fencing=2]" {
			t.Fatalf("fencing tokens %v", column(steps, 3))
		}
		record, err = c.Get(ctx, ns, "job-1")
		if err != nil || record.State != idempotency.StateCompleted || string(record.Response) != `["reserve","charge","email"]` || record.Checkpoint != nil {
			t.Fatalf("%+v %v", record, err)
		}

		// A later delivery replays the result and does no step.
		again, out := runWorker(t, args)
		if !again.Success() || out != `["reserve","charge","email"]` || len(stepsDone(t, log)) != 3 {
			t.Fatalf("a later delivery: %v %q, %d steps", again, out, len(stepsDone(t, log)))
		}
	})
}

func stepsDone(t *testing.T, path string) [][]string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var steps [][]string
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		steps = append(steps, strings.Fields(line))
	}
	return steps
}

func column(rows [][]string, i int) []string {
	var out []string
	for _, row := range rows {
		out = append(out, row[i])
	}
	return out
}

func TestClaimResultsExposeCheckpointFieldsEvenWhenEmpty(t *testing.T) {
	c, ns, ctx := client(t), namespace(t), ctx(t)
	claim, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{})
	if err != nil || !claim.Claimed() || claim.Checkpoint != nil || claim.CheckpointFencingToken != 0 || claim.Retried {
		t.Fatalf("%+v %v", claim, err)
	}
	other, err := c.Claim(ctx, ns, "k", idempotency.ClaimOptions{})
	if err != nil || other.Outcome != idempotency.OutcomeInProgress || other.Checkpoint != nil || other.Retried || other.WaitHonored {
		t.Fatalf("%+v %v", other, err)
	}
}
