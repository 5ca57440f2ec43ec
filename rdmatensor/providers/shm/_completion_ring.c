/* The shm completion ring's per-message operations, compiled (completion_ring.py has
 * the layout, the ordering argument and the same operations in Python).
 *
 * Per message, the Python ring packed a struct, took a lock as a fence, and
 * the consumer unpacked, checked and dispatched each entry in a Python loop:
 * about a third of a round trip.  Here push() is one 32-byte store, head's
 * store and one mfence; drain() copies each entry out of shared memory,
 * checks it as a NIC would (region exposed, key, bounds, from the same
 * `local` table the channel keeps) and calls on_imm with its immediate.
 * An entry that fails a check is not consumed: drain() returns -1 and leaves
 * it in `refused`, so that the channel raises its own typed error for it.
 * Everything runs under the GIL, as the Python version did.
 */
#include "../emulated/_write_header.h"
#include <sched.h>
#include <string.h>

#define HEAD_AT 64
#define TAIL_AT 128
#define SLEEPING_AT 192
#define HEADER_BYTES 256

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    char *entry0;
    uint64_t *head_word, *tail_word, *sleeping_word;
    uint64_t entries, mask;
    uint64_t head;           /* the producer's own count of entries published */
    uint64_t rang;           /* the producer's: the sleep it last rang the doorbell for */
    uint64_t sleeps;         /* the consumer's: how many times it went to sleep */
    uint64_t tail;           /* the consumer's own count (never read back from shared memory) */
    PyObject *refused;       /* the entry drain() would not take in, as a tuple */
} Ring;

static int Ring_init(Ring *self, PyObject *args, PyObject *kw) {
    PyObject *buf;
    unsigned long long entries;
    static char *names[] = {"buffer", "entries", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OK", names, &buf, &entries))
        return -1;
    if (self->has_view) {
        PyErr_SetString(PyExc_RuntimeError, "a Ring is initialized once");
        return -1;
    }
    if (entries == 0 || (entries & (entries - 1))) {
        PyErr_Format(PyExc_ValueError, "a ring's entries are a power of two, not %llu", entries);
        return -1;
    }
    if (PyObject_GetBuffer(buf, &self->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    self->has_view = 1;
    if ((uint64_t)self->view.len < HEADER_BYTES + entries * sizeof(entry_t)) {
        PyErr_Format(PyExc_ValueError, "%zd bytes hold no ring of %llu entries", self->view.len, entries);
        return -1;
    }
    if ((uintptr_t)self->view.buf % 64) {
        PyErr_SetString(PyExc_ValueError, "a ring's memory starts on a cache line");
        return -1;
    }
    char *base = self->view.buf;
    self->head_word = (uint64_t *)(base + HEAD_AT);
    self->tail_word = (uint64_t *)(base + TAIL_AT);
    self->sleeping_word = (uint64_t *)(base + SLEEPING_AT);
    self->entry0 = base + HEADER_BYTES;
    self->entries = entries;
    self->mask = entries - 1;
    return 0;
}

static int live(Ring *self) {
    if (self->has_view)
        return 1;
    PyErr_SetString(PyExc_ValueError, "the ring is closed");
    return 0;
}

/* Publish one entry: -1 (nothing written) while the ring is full; else 1 if
 * the consumer sleeps and nobody rang for this sleep yet (ring it), or 0. */
static int push_entry(Ring *self, const entry_t *e) {
    uint64_t head = self->head;
    if (head - __atomic_load_n(self->tail_word, __ATOMIC_ACQUIRE) >= self->entries)
        return -1;
    memcpy(self->entry0 + (head & self->mask) * sizeof(entry_t), e, sizeof *e);
    self->head = head + 1;
    __atomic_store_n(self->head_word, head + 1, __ATOMIC_RELEASE);
    /* head stored before `sleeping` is read: the consumer does the mirror image */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint64_t sleep = __atomic_load_n(self->sleeping_word, __ATOMIC_ACQUIRE);
    if (!sleep || sleep == self->rang)
        return 0;
    self->rang = sleep;
    return 1;
}

static PyObject *pushed(int r) {
    if (r < 0)
        Py_RETURN_NONE;
    return PyBool_FromLong(r);
}

/* The entry's region, key and immediate from Python ints (32-bit each). */
static int entry_ids(entry_t *e, PyObject *region_obj, PyObject *key_obj, PyObject *imm_obj) {
    long region = PyLong_AsLong(region_obj);
    unsigned long key = PyLong_AsUnsignedLong(key_obj);
    unsigned long imm = PyLong_AsUnsignedLong(imm_obj);
    if (PyErr_Occurred())
        return -1;
    if (region < INT32_MIN || region > INT32_MAX || key > UINT32_MAX || imm > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "a ring entry's region, key and immediate are 32-bit");
        return -1;
    }
    e->magic = WRITE_MAGIC;
    e->region = (int32_t)region;
    e->key = (uint32_t)key;
    e->imm = (uint32_t)imm;
    return 0;
}

/* push(region, key, imm, offset, length): None (nothing written) while full;
 * else True if the consumer sleeps and nobody rang for this sleep yet. */
static PyObject *Ring_push(Ring *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "push(region, key, imm, offset, length)");
        return NULL;
    }
    if (!live(self))
        return NULL;
    entry_t e;
    if (entry_ids(&e, args[0], args[1], args[2]) < 0)
        return NULL;
    e.offset = PyLong_AsUnsignedLongLong(args[3]);
    e.length = PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    return pushed(push_entry(self, &e));
}

/* write(target, offset, src, region, key, imm): copy `src` into the mapped
 * `target` at `offset` (both contiguous; ValueError, nothing copied, if it
 * does not fit), then push its entry, as push() says. One call for a small
 * write; large ones stream in Python (streaming.py), then push(). */
static PyObject *Ring_write(Ring *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "write(target, offset, src, region, key, imm)");
        return NULL;
    }
    if (!live(self))
        return NULL;
    entry_t e;
    if (entry_ids(&e, args[3], args[4], args[5]) < 0)
        return NULL;
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer target, src;
    if (PyObject_GetBuffer(args[0], &target, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[2], &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&target);
        return NULL;
    }
    int fits = offset >= 0 && offset <= target.len && src.len <= target.len - offset;
    if (fits)
        memcpy((char *)target.buf + offset, src.buf, src.len);
    e.offset = (uint64_t)offset;
    e.length = (uint64_t)src.len;
    Py_ssize_t target_len = target.len;
    PyBuffer_Release(&src);
    PyBuffer_Release(&target);
    if (!fits) {
        PyErr_Format(PyExc_ValueError, "a %llu-byte write at %zd does not fit %zd bytes",
                     (unsigned long long)e.length, offset, target_len);
        return NULL;
    }
    return pushed(push_entry(self, &e));
}

/* write_many(targets, writes, below): Ring.write() of each (region, offset,
 * src, imm) in order, the region looked up in `targets` (region id ->
 * (mapped buffer, size, key)), while each is a contiguous buffer of 1 to
 * below-1 bytes that fits its region and the ring has room.  Stops at the
 * first that is not (left to the caller, whose one-at-a-time path copies,
 * streams, waits or raises); (how many went, whether the doorbell must ring). */
static PyObject *Ring_write_many(Ring *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "write_many(targets, writes, below)");
        return NULL;
    }
    if (!live(self))
        return NULL;
    if (!PyDict_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "write_many()'s targets are a dict");
        return NULL;
    }
    Py_ssize_t below = PyLong_AsSsize_t(args[2]);
    if (below == -1 && PyErr_Occurred())
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "write_many() takes a list of (region, offset, src, imm)");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), done = 0;
    int bell = 0;
    for (; done < n; done++) {
        PyObject *w = PySequence_Fast_GET_ITEM(seq, done);
        if (!PyTuple_Check(w) || PyTuple_GET_SIZE(w) != 4 || !PyObject_CheckBuffer(PyTuple_GET_ITEM(w, 2)))
            break;               /* Pieces, or not a write at all: the caller's path */
        PyObject *target = PyDict_GetItemWithError(args[0], PyTuple_GET_ITEM(w, 0));   /* borrowed */
        if (!target || !PyTuple_Check(target) || PyTuple_GET_SIZE(target) != 3) {
            PyErr_Clear();       /* a lookup error: the caller's write() raises what is wrong */
            break;
        }
        entry_t e;
        Py_ssize_t offset = PyLong_AsSsize_t(PyTuple_GET_ITEM(w, 1));
        Py_ssize_t size = PyLong_AsSsize_t(PyTuple_GET_ITEM(target, 1));
        if (PyErr_Occurred() || entry_ids(&e, PyTuple_GET_ITEM(w, 0), PyTuple_GET_ITEM(target, 2),
                                          PyTuple_GET_ITEM(w, 3)) < 0) {
            PyErr_Clear();
            break;
        }
        if (self->head - __atomic_load_n(self->tail_word, __ATOMIC_ACQUIRE) >= self->entries)
            break;               /* full: the caller waits for room */
        Py_buffer src, dst;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(w, 2), &src, PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            break;
        }
        int ok = src.len > 0 && src.len < below && offset >= 0 && src.len <= size && offset <= size - src.len;
        if (ok && PyObject_GetBuffer(PyTuple_GET_ITEM(target, 0), &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            ok = 0;
        } else if (ok) {
            ok = offset + src.len <= dst.len;
            if (ok)
                memcpy((char *)dst.buf + offset, src.buf, src.len);
            PyBuffer_Release(&dst);
        }
        e.offset = (uint64_t)offset;
        e.length = (uint64_t)src.len;
        PyBuffer_Release(&src);
        if (!ok)
            break;
        bell |= push_entry(self, &e) == 1;     /* room was checked above */
    }
    Py_DECREF(seq);
    return Py_BuildValue("(nO)", done, bell ? Py_True : Py_False);
}

/* Take in up to `most` entries, each checked, then reported (on_imm(imm); a
 * true result means the channel is lost: take in nothing more).  How many
 * were taken in; -1 when the next entry, or head itself, is the producer's
 * fault (`refused` says which); -2 with a Python error set. */
static long long drain_some(Ring *self, uint64_t most, PyObject *local, PyObject *on_imm, int *stop) {
    uint64_t head = __atomic_load_n(self->head_word, __ATOMIC_ACQUIRE);
    uint64_t n = head - self->tail;
    if (!n)
        return 0;
    if (n > self->entries) {
        Py_XSETREF(self->refused, Py_BuildValue("(K)", (unsigned long long)head));
        return self->refused ? -1 : -2;
    }
    if (most < n)
        n = most;
    uint64_t taken = 0;
    long long result = -2;
    while (taken < n) {
        entry_t e;               /* copied out before it is checked: the producer may scribble on it */
        memcpy(&e, self->entry0 + ((self->tail + taken) & self->mask) * sizeof(entry_t), sizeof e);
        int ok = lands(&e, local);
        if (ok < 0)
            goto done;
        if (!ok) {
            Py_XSETREF(self->refused, entry_tuple(&e));
            result = self->refused ? -1 : -2;
            goto done;
        }
        PyObject *imm = PyLong_FromUnsignedLong(e.imm);
        if (!imm)
            goto done;
        PyObject *said = PyObject_CallOneArg(on_imm, imm);
        Py_DECREF(imm);
        taken++;
        if (!said)
            goto done;
        *stop = said != Py_None && PyObject_IsTrue(said);
        Py_DECREF(said);
        if (*stop)
            break;
    }
    result = (long long)taken;
done:
    if (taken) {
        self->tail += taken;
        __atomic_store_n(self->tail_word, self->tail, __ATOMIC_RELEASE);
    }
    return result;
}

static int drain_args(Ring *self, PyObject *const *args, uint64_t *most, PyObject **local) {
    if (!live(self))
        return -1;
    Py_ssize_t m = PyLong_AsSsize_t(args[0]);
    if (m == -1 && PyErr_Occurred())
        return -1;
    if (m < 1) {
        PyErr_SetString(PyExc_ValueError, "drain at least one entry at a time");
        return -1;
    }
    if (!PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "the local regions are a dict");
        return -1;
    }
    *most = (uint64_t)m;
    *local = args[1];
    return 0;
}

/* drain(most, local, on_imm): drain_some() once. */
static PyObject *Ring_drain(Ring *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t most;
    PyObject *local;
    int stop = 0;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "drain(most, local, on_imm)");
        return NULL;
    }
    if (drain_args(self, args, &most, &local) < 0)
        return NULL;
    long long n = drain_some(self, most, local, args[2], &stop);
    return n == -2 ? NULL : PyLong_FromLongLong(n);
}

/* poll(event, most, local, on_imm, seconds): drain until event.is_set() (an
 * event of None: until any entry was taken in), the channel is lost, or
 * `seconds` passed, yielding the core between looks (with the GIL released,
 * so that the channel's other threads run).  How many were taken in; -1 as
 * drain(). */
static PyObject *Ring_poll(Ring *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t most;
    PyObject *local;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "poll(event, most, local, on_imm, seconds)");
        return NULL;
    }
    PyObject *event = args[0];
    double seconds = PyFloat_AsDouble(args[4]);
    if (seconds == -1.0 && PyErr_Occurred())
        return NULL;
    if (drain_args(self, args + 1, &most, &local) < 0)
        return NULL;
    double until = 0.0;
    long long found = 0;
    for (;;) {
        int stop = 0;
        long long n = drain_some(self, most, local, args[3], &stop);
        if (n < 0)
            return n == -2 ? NULL : PyLong_FromLong(-1);
        found += n;
        if (stop)
            break;
        if (event == Py_None) {
            if (found)
                break;
        } else {                 /* set by an entry, or by another thread (a loss wakes every waiter) */
            int done = event_is_set(event);
            if (done < 0)
                return NULL;
            if (done)
                break;
        }
        double t = monotonic_now();
        if (!until)
            until = t + seconds;
        else if (t >= until)
            break;
        Py_BEGIN_ALLOW_THREADS
        sched_yield();           /* a peer sharing this core runs now, not at the next tick */
        Py_END_ALLOW_THREADS
        if (!live(self))         /* closed meanwhile (the channel waits for its reader first) */
            return NULL;
    }
    return PyLong_FromLongLong(found);
}

/* How many entries wait; -1 when head is not to be believed. */
static PyObject *Ring_available(Ring *self, PyObject *unused) {
    if (!live(self))
        return NULL;
    uint64_t n = __atomic_load_n(self->head_word, __ATOMIC_ACQUIRE) - self->tail;
    return PyLong_FromLongLong(n > self->entries ? -1 : (long long)n);
}

/* sleeping(True): a new sleep's number is stored, then a full barrier, so the
 * consumer's next look at head sees any entry whose producer missed it. */
static PyObject *Ring_sleeping(Ring *self, PyObject *flag) {
    if (!live(self))
        return NULL;
    int asleep = PyObject_IsTrue(flag);
    if (asleep < 0)
        return NULL;
    if (asleep) {
        __atomic_store_n(self->sleeping_word, ++self->sleeps, __ATOMIC_RELEASE);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
    } else {
        __atomic_store_n(self->sleeping_word, 0, __ATOMIC_RELEASE);
    }
    Py_RETURN_NONE;
}

static PyObject *Ring_consumer_sleeping(Ring *self, PyObject *unused) {
    if (!live(self))
        return NULL;
    return PyBool_FromLong(__atomic_load_n(self->sleeping_word, __ATOMIC_ACQUIRE) != 0);
}

static PyObject *Ring_close(Ring *self, PyObject *unused) {
    if (self->has_view) {
        self->has_view = 0;
        PyBuffer_Release(&self->view);
    }
    Py_RETURN_NONE;
}

static void Ring_dealloc(Ring *self) {
    if (self->has_view)
        PyBuffer_Release(&self->view);
    Py_XDECREF(self->refused);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Ring_get_refused(Ring *self, void *unused) {
    PyObject *r = self->refused ? self->refused : Py_None;
    Py_INCREF(r);
    return r;
}

#define COUNTER(field)                                                                   \
    static PyObject *Ring_get_##field(Ring *self, void *unused) {                        \
        return PyLong_FromUnsignedLongLong(self->field);                                 \
    }
COUNTER(head)
COUNTER(tail)
COUNTER(entries)

static PyGetSetDef Ring_getset[] = {
    {"head", (getter)Ring_get_head, NULL, "entries this producer published", NULL},
    {"tail", (getter)Ring_get_tail, NULL, "entries this consumer took in", NULL},
    {"entries", (getter)Ring_get_entries, NULL, "the ring's capacity", NULL},
    {"refused", (getter)Ring_get_refused, NULL,
     "what the last drain() returning -1 would not take in: (head,) or an entry", NULL},
    {NULL},
};

static PyMethodDef Ring_methods[] = {
    {"push", (PyCFunction)(void (*)(void))Ring_push, METH_FASTCALL, "push(region, key, imm, offset, length)"},
    {"write_many", (PyCFunction)(void (*)(void))Ring_write_many, METH_FASTCALL,
     "write_many(targets, writes, below) -> (written, ring the doorbell)"},
    {"write", (PyCFunction)(void (*)(void))Ring_write, METH_FASTCALL,
     "write(target, offset, src, region, key, imm): copy, then push"},
    {"drain", (PyCFunction)(void (*)(void))Ring_drain, METH_FASTCALL, "drain(most, local, on_imm) -> taken, or -1"},
    {"poll", (PyCFunction)(void (*)(void))Ring_poll, METH_FASTCALL,
     "poll(event, most, local, on_imm, seconds) -> taken, or -1"},
    {"available", (PyCFunction)Ring_available, METH_NOARGS, "entries waiting, or -1"},
    {"sleeping", (PyCFunction)Ring_sleeping, METH_O, "sleeping(flag)"},
    {"consumer_sleeping", (PyCFunction)Ring_consumer_sleeping, METH_NOARGS, "whether the consumer sleeps"},
    {"close", (PyCFunction)Ring_close, METH_NOARGS, "let go of the ring's memory"},
    {NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rdmatensor.providers.shm._completion_ring.Ring",
    .tp_basicsize = sizeof(Ring),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ring(buffer, entries): one side of an shm completion ring",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Ring_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_methods = Ring_methods,
    .tp_getset = Ring_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_completion_ring", "The shm completion ring, compiled.", -1, NULL};

PyMODINIT_FUNC PyInit__completion_ring(void) {
    if (PyType_Ready(&RingType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&RingType);
    if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0) {
        Py_DECREF(&RingType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
