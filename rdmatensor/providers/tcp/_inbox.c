/* tcp's inbox, compiled (inbox.py has the same in Python, and the contract).
 *
 * Per message, the Python receiver called recv_into, unpacked a header,
 * checked it, sliced memoryviews and copied in about ten interpreter frames,
 * and spun on the socket in Python.  Here one poll() reads what the socket
 * holds into a small buffer (the GIL released around each system call),
 * checks every complete header as a NIC checks a write (emulated/_write_header.h), lands
 * its payload (what is buffered copied, the rest received straight into the
 * region) and hands its immediate to on_imm, spinning with sched_yield until
 * the awaited event is set or the time is up.
 *
 * The inbox reads from its own duplicate of the socket's descriptor, closed
 * only by close(), which the channel calls while no poll() runs: a
 * descriptor number closed and reused elsewhere meanwhile is never read.
 */
#include "../emulated/_write_header.h"
#include <errno.h>
#include <sched.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

enum { REFUSED = -1, CLOSED = -2, CLOSED_MID = -3, PY_ERROR = -4 };

typedef struct {
    PyObject_HEAD
    int fd;                  /* our duplicate; -1 once closed */
    char *buf;
    Py_ssize_t cap, start, end;   /* buf[start:end] is received, not taken in yet */
    PyObject *refused;       /* the header poll() returning -1 would not take in */
} Inbox;

static PyObject *Inbox_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Inbox *self = (Inbox *)type->tp_alloc(type, 0);
    if (self)
        self->fd = -1;       /* never descriptor 0 by accident */
    return (PyObject *)self;
}

static int Inbox_init(Inbox *self, PyObject *args, PyObject *kw) {
    int fd;
    Py_ssize_t cap;
    static char *names[] = {"fd", "capacity", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "in", names, &fd, &cap))
        return -1;
    if (self->buf) {
        PyErr_SetString(PyExc_RuntimeError, "an Inbox is initialized once");
        return -1;
    }
    if (cap < 2 * (Py_ssize_t)sizeof(entry_t)) {
        PyErr_Format(PyExc_ValueError, "an inbox holds at least two headers, not %zd bytes", cap);
        return -1;
    }
    if (!(self->buf = PyMem_Malloc(cap))) {
        PyErr_NoMemory();
        return -1;
    }
    self->cap = cap;
    if ((self->fd = dup(fd)) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

/* recv() once, the GIL released: bytes, 0 at the peer's end, -1 with errno. */
static Py_ssize_t recv_once(int fd, char *into, size_t most, int flags) {
    Py_ssize_t n;
    Py_BEGIN_ALLOW_THREADS
    n = recv(fd, into, most, flags);
    Py_END_ALLOW_THREADS
    return n;
}

/* Fill exactly `want` bytes, blocking: 0, CLOSED_MID, or PY_ERROR. */
static int recv_exact(int fd, char *into, size_t want) {
    while (want) {
        Py_ssize_t n = recv_once(fd, into, want, 0);
        if (n > 0) {
            into += n;
            want -= n;
        } else if (n == 0) {
            return CLOSED_MID;
        } else if (errno != EINTR) {
            PyErr_SetFromErrno(PyExc_OSError);
            return PY_ERROR;
        } else if (PyErr_CheckSignals() < 0) {
            return PY_ERROR;
        }
    }
    return 0;
}

/* Land `e` (checked) whose payload starts at buf[start + 32]. 0 or an error code. */
static int land_payload(Inbox *self, const entry_t *e, PyObject *local) {
    static PyObject *buf_name;
    if (!buf_name && !(buf_name = PyUnicode_InternFromString("buf")))
        return PY_ERROR;
    PyObject *pair = local_pair(e, local);
    if (!pair) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "a checked region went away");
        return PY_ERROR;
    }
    PyObject *memory = PyObject_GetAttr(PyTuple_GET_ITEM(pair, 0), buf_name);
    if (!memory)
        return PY_ERROR;
    Py_buffer region;
    int got = PyObject_GetBuffer(memory, &region, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS);
    Py_DECREF(memory);
    if (got < 0)
        return PY_ERROR;
    int r = 0;
    if (e->offset > (uint64_t)region.len || e->length > (uint64_t)region.len - e->offset) {
        PyErr_SetString(PyExc_RuntimeError, "a region is smaller than its size says");
        r = PY_ERROR;
        goto done;
    }
    char *at = (char *)region.buf + e->offset;
    Py_ssize_t buffered = self->end - self->start - (Py_ssize_t)sizeof(entry_t);
    Py_ssize_t have = (uint64_t)buffered < e->length ? buffered : (Py_ssize_t)e->length;
    memcpy(at, self->buf + self->start + sizeof(entry_t), have);
    if ((uint64_t)have < e->length) {       /* the rest straight into the region */
        self->start = self->end = 0;
        r = recv_exact(self->fd, at + have, e->length - have);
    } else {
        self->start += sizeof(entry_t) + have;
    }
done:
    PyBuffer_Release(&region);
    return r;
}

/* Take in every write whose header is buffered: how many, or an error code.
 * *stop: on_imm said the channel is lost. */
static long long land_buffered(Inbox *self, PyObject *local, PyObject *on_imm, int *stop) {
    long long found = 0;
    while (!*stop && self->end - self->start >= (Py_ssize_t)sizeof(entry_t)) {
        entry_t e;
        memcpy(&e, self->buf + self->start, sizeof e);
        int ok = lands(&e, local);
        if (ok < 0)
            return PY_ERROR;
        if (!ok) {
            Py_XSETREF(self->refused, entry_tuple(&e));
            return self->refused ? REFUSED : PY_ERROR;
        }
        if (e.length) {
            int r = land_payload(self, &e, local);
            if (r < 0)
                return r;
        } else {
            self->start += sizeof e;
        }
        PyObject *imm = PyLong_FromUnsignedLong(e.imm);
        if (!imm)
            return PY_ERROR;
        PyObject *said = PyObject_CallOneArg(on_imm, imm);
        Py_DECREF(imm);
        if (!said)
            return PY_ERROR;
        found++;
        *stop = said != Py_None && PyObject_IsTrue(said);
        Py_DECREF(said);
    }
    return found;
}

/* Move what the socket holds into the buffer, never blocking: bytes (0: none
 * yet), or an error code. */
static Py_ssize_t fill(Inbox *self) {
    if (self->start == self->end) {
        self->start = self->end = 0;
    } else if (self->cap - self->end < (Py_ssize_t)sizeof(entry_t)) {   /* room for a header */
        memmove(self->buf, self->buf + self->start, self->end - self->start);
        self->end -= self->start;
        self->start = 0;
    }
    Py_ssize_t n = recv_once(self->fd, self->buf + self->end, self->cap - self->end, MSG_DONTWAIT);
    if (n > 0) {
        self->end += n;
        return n;
    }
    if (n == 0)
        return self->start == self->end ? CLOSED : CLOSED_MID;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
        return 0;
    PyErr_SetFromErrno(PyExc_OSError);
    return PY_ERROR;
}

static PyObject *result(long long r) {
    return r == PY_ERROR ? NULL : PyLong_FromLongLong(r);
}

/* poll(event, local, on_imm, seconds): inbox.py's Inbox.poll. */
static PyObject *Inbox_poll(Inbox *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "poll(event, local, on_imm, seconds)");
        return NULL;
    }
    PyObject *event = args[0], *local = args[1], *on_imm = args[2];
    if (!PyDict_Check(local)) {
        PyErr_SetString(PyExc_TypeError, "the local regions are a dict");
        return NULL;
    }
    double seconds = PyFloat_AsDouble(args[3]);
    if (seconds == -1.0 && PyErr_Occurred())
        return NULL;
    double until = 0.0;
    long long found = 0;
    for (;;) {
        if (self->fd < 0) {      /* closed meanwhile */
            PyErr_SetString(PyExc_ValueError, "the inbox is closed");
            return NULL;
        }
        int stop = 0;
        long long n = land_buffered(self, local, on_imm, &stop);
        if (n < 0)
            return result(n);
        found += n;
        if (stop)
            break;
        if (event == Py_None) {
            if (found)
                break;
        } else {                 /* set by a write, or by another thread (a loss wakes every waiter) */
            int done = event_is_set(event);
            if (done < 0)
                return NULL;
            if (done)
                break;
        }
        Py_ssize_t got = fill(self);
        if (got < 0)
            return result(got);
        if (got)
            continue;
        double t = monotonic_now();
        if (!until)
            until = t + seconds;
        else if (t >= until)
            break;
        Py_BEGIN_ALLOW_THREADS
        sched_yield();           /* a peer sharing this core runs now, not at the next tick */
        Py_END_ALLOW_THREADS
    }
    return PyLong_FromLongLong(found);
}

static PyObject *Inbox_close(Inbox *self, PyObject *unused) {
    if (self->fd >= 0) {
        close(self->fd);
        self->fd = -1;
    }
    Py_RETURN_NONE;
}

static void Inbox_dealloc(Inbox *self) {
    if (self->fd >= 0)
        close(self->fd);
    PyMem_Free(self->buf);
    Py_XDECREF(self->refused);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Inbox_get_refused(Inbox *self, void *unused) {
    PyObject *r = self->refused ? self->refused : Py_None;
    Py_INCREF(r);
    return r;
}

static PyObject *Inbox_get_buffered(Inbox *self, void *unused) {
    return PyLong_FromSsize_t(self->end - self->start);
}

static PyGetSetDef Inbox_getset[] = {
    {"refused", (getter)Inbox_get_refused, NULL, "the header the last poll() returning -1 would not take in", NULL},
    {"buffered", (getter)Inbox_get_buffered, NULL, "bytes received, not taken in yet", NULL},
    {NULL},
};

static PyMethodDef Inbox_methods[] = {
    {"poll", (PyCFunction)(void (*)(void))Inbox_poll, METH_FASTCALL,
     "poll(event, local, on_imm, seconds) -> taken in, or -1 (refused), -2 (closed), -3 (closed mid-message)"},
    {"close", (PyCFunction)Inbox_close, METH_NOARGS, "close the inbox's descriptor"},
    {NULL},
};

static PyTypeObject InboxType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rdmatensor.providers.tcp._inbox.Inbox",
    .tp_basicsize = sizeof(Inbox),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Inbox(fd, capacity): what a tcp connection delivers, taken in",
    .tp_new = Inbox_new,
    .tp_init = (initproc)Inbox_init,
    .tp_dealloc = (destructor)Inbox_dealloc,
    .tp_methods = Inbox_methods,
    .tp_getset = Inbox_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_inbox", "tcp's inbox, compiled.", -1, NULL};

PyMODINIT_FUNC PyInit__inbox(void) {
    if (PyType_Ready(&InboxType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&InboxType);
    if (PyModule_AddObject(m, "Inbox", (PyObject *)&InboxType) < 0) {
        Py_DECREF(&InboxType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
