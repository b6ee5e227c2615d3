async fn receive(
    endpoint: ProcessorWebhooks,
    ::idem_runtime::signature::Input {
        value: Verified(event),
        request: __idem_request,
        ..
    }: ::idem_runtime::signature::Input<
        Verified<Event>,
        Postgres,
        ::idem_runtime::signature::KeyAt<14655353244370692571u64>,
    >,
) -> ::idem_runtime::__private::Response {
    static __IDEM_POLICY: ::idem_runtime::__private::HandlerPolicy = ::idem_runtime::__private::HandlerPolicy::__new(
            "receive",
            ::core::module_path!(),
            ::idem_runtime::__private::KeyScope::Parameter("endpoint"),
            ::idem_runtime::__private::Mode::Transactional,
            259200u64,
            false,
            30u64,
            ::core::option::Option::None,
            ::core::option::Option::None,
            ::idem_runtime::__private::BodyFields::All,
        )
        .__key(::idem_runtime::KeySource::Header("webhook-id"), false);
    ::idem_runtime::__private::inventory::submit! {
        ::idem_runtime::__private::Registered(& __IDEM_POLICY)
    }
    ::idem_runtime::__private::inventory::submit! {
        ::idem_runtime::__private::KeySpec { id : 14655353244370692571u64, source :
        ::idem_runtime::KeySource::Header("webhook-id"), optional : false }
    }
    let __idem_span = __idem_request.span();
    ::idem_runtime::__private::Instrument::instrument(
            async move {
                let __idem_scope = ::idem_runtime::__private::StoredScope::Caller(
                    ::std::borrow::Cow::into_owned(
                        ::idem_runtime::IdempotencyScope::idempotency_scope(&endpoint),
                    ),
                );
                let __idem_options = __IDEM_POLICY.__options();
                let mut __idem_attempt = ::idem_runtime::__private::Attempt::from(
                    __idem_request,
                );
                loop {
                    let mut __idem_slot = ::core::option::Option::None;
                    #[allow(unused_mut)]
                    let mut __idem_claim = match ::idem_runtime::__private::Claim::<
                        Postgres,
                    >::acquire(
                            &mut __idem_slot,
                            __idem_attempt,
                            &__idem_scope,
                            __idem_options,
                        )
                        .await
                    {
                        ::idem_runtime::__private::Acquired::Claimed(__idem_claim) => {
                            __idem_claim
                        }
                        ::idem_runtime::__private::Acquired::Again(__idem_again) => {
                            __idem_attempt = __idem_again;
                            continue;
                        }
                        ::idem_runtime::__private::Acquired::Answer(__idem_answer) => {
                            return __idem_answer;
                        }
                    };
                    fn __idem_into_response(
                        __idem_output: Json<Value>,
                    ) -> ::idem_runtime::__private::Response {
                        ::idem_runtime::__private::IntoResponse::into_response(
                            __idem_output,
                        )
                    }
                    let __idem_limit = __idem_claim.limit();
                    let __idem_output = {
                        let tx: &mut Transaction<'_, Postgres> = __idem_claim
                            .transaction();
                        ::idem_runtime::__private::run_until(
                                __idem_limit,
                                ::idem_runtime::__private::typed_body::<
                                    Json<Value>,
                                    _,
                                >(async move { credit(tx, event).await }),
                            )
                            .await
                    };
                    let __idem_response = match __idem_output {
                        ::core::option::Option::Some(__idem_value) => {
                            __idem_into_response(__idem_value)
                        }
                        ::core::option::Option::None => {
                            return __idem_claim.stopped(__idem_limit).await;
                        }
                    };
                    return __idem_claim.complete(__idem_response).await;
                }
            },
            __idem_span,
        )
        .await
}
